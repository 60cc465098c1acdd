"""Load and faults against a real `sdrt serve` process on loopback (the tiny random SD1 checkpoint,
1 step at 64x64, -t 1): concurrent clients submit, poll and cancel while others disconnect
mid-job, send malformed, huge and slow requests. Checks: the queue limit holds (429s, never more
than --max-queue pending), every accepted job ends exactly once (none lost), the server answers
throughout, its RSS stays flat after warm-up.

Bounded by default (12 clients, 20 s: 2 shared cores); the issue's long mode is
`SDRT_LOAD_CLIENTS=50 SDRT_LOAD_SECONDS=600 python -m pytest -q -s tests/test_server_load.py`."""
import json
import os
import random
import socket
import subprocess
import sys
import threading
import time

import pytest

httpx = pytest.importorskip("httpx")
pytest.importorskip("starlette")
from test_server_tiny import write_tiny_sd1  # noqa: E402

CLIENTS = int(os.environ.get("SDRT_LOAD_CLIENTS", "12"))
SECONDS = float(os.environ.get("SDRT_LOAD_SECONDS", "20"))
MAX_QUEUE = 8
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def rss_kib(pid):
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not sys.platform.startswith("linux"):
        pytest.skip("reads /proc for the RSS")
    ckpt = write_tiny_sd1(tmp_path_factory.mktemp("load") / "tiny-sd1.safetensors")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    env = dict(os.environ, PYTHONPATH=ROOT)
    # the server's log goes to a file: a pipe nobody reads fills up (64 KiB) within minutes of
    # per-request warnings and then blocks the server on its next write
    log = open(tmp_path_factory.mktemp("load-log") / "server.log", "w+b")
    proc = subprocess.Popen([sys.executable, "-m", "sdrt.cli.main", "serve", "-m", ckpt, "--listen-port", str(port),
                             "-W", "64", "-H", "64", "--steps", "1", "-t", "1", "--max-queue", str(MAX_QUEUE),
                             "--job-ttl", "5", "--max-body-mb", "1", "--log-level", "warn"],
                            env=env, stdout=subprocess.DEVNULL, stderr=log)
    url = f"http://127.0.0.1:{port}"
    t0 = time.time()
    while time.time() - t0 < 120:
        try:
            if httpx.get(url + "/v1/models", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
        if proc.poll() is not None:
            log.seek(0)
            raise AssertionError(log.read().decode()[-2000:])
    yield url, proc, port
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
    log.seek(0)
    print(f"server log: {len(log.read())} bytes")
    log.close()


def test_load_and_faults(server):
    url, proc, port = server
    stop = time.time() + SECONDS
    accepted, finals, statuses, errors = [], {}, {}, []
    lock = threading.Lock()
    max_pending_seen = [0]

    def note(code):
        with lock:
            statuses[code] = statuses.get(code, 0) + 1

    def client(i):
        rnd = random.Random(i)
        with httpx.Client(base_url=url, timeout=60) as c:
            while time.time() < stop:
                try:
                    kind = rnd.random()
                    if kind < 0.55:       # async job, polled to its end, sometimes cancelled
                        r = c.post("/sdcpp/v1/img_gen", json={"prompt": f"client {i}", "seed": rnd.randrange(1000)})
                        note(r.status_code)
                        if r.status_code != 202:
                            assert r.status_code == 429 and r.json()["error"] == "job queue is full", r.text
                            time.sleep(0.05)
                            continue
                        jid = r.json()["id"]
                        with lock:
                            accepted.append(jid)
                        if rnd.random() < 0.3:
                            for _ in range(rnd.randrange(1, 6)):       # a cancel storm on one job
                                note(c.post(f"/sdcpp/v1/jobs/{jid}/cancel").status_code)
                        while True:
                            j = c.get(f"/sdcpp/v1/jobs/{jid}").json()
                            if j["status"] in ("completed", "failed", "cancelled"):
                                with lock:
                                    assert jid not in finals
                                    finals[jid] = j["status"]
                                break
                            time.sleep(0.05)
                    elif kind < 0.75:     # synchronous OpenAI request
                        r = c.post("/v1/images/generations", json={"prompt": f"sync {i}", "size": "64x64"})
                        note(r.status_code)
                        assert r.status_code in (200, 429), r.text
                    elif kind < 0.85:     # queue view: never more pending than the limit
                        q = c.get("/sdcpp/v1/queue").json()
                        pending = len(q["queued"]) + (q["current"] is not None)
                        with lock:
                            max_pending_seen[0] = max(max_pending_seen[0], pending)
                    else:                 # malformed bodies
                        body = bytes(rnd.randrange(256) for _ in range(rnd.randrange(0, 300)))
                        r = c.post(rnd.choice(["/sdcpp/v1/img_gen", "/v1/images/generations", "/sdapi/v1/txt2img",
                                               "/v1/images/edits"]), content=body,
                                   headers={"Content-Type": rnd.choice(["application/json", "multipart/form-data; boundary=x"])})
                        note(r.status_code)
                        assert 400 <= r.status_code < 500 and "error" in r.json(), r.text
                except AssertionError as e:
                    with lock:
                        errors.append(str(e)[:300])
                except httpx.HTTPError as e:
                    with lock:
                        errors.append(f"transport: {e!r}"[:300])

    def burst():
        """2x --max-queue jobs posted back to back: the queue limit is reached whatever the load,
        and every job it accepted is polled to its end like the clients' jobs."""
        mine = []
        with httpx.Client(base_url=url, timeout=60) as c:
            for k in range(2 * MAX_QUEUE):
                r = c.post("/sdcpp/v1/img_gen", json={"prompt": f"burst {k}", "seed": k})
                note(r.status_code)
                if r.status_code == 202:
                    mine.append(r.json()["id"])
                elif not (r.status_code == 429 and r.json()["error"] == "job queue is full"):
                    with lock:
                        errors.append(f"burst: {r.status_code} {r.text[:200]}")
            with lock:
                accepted.extend(mine)
            for jid in mine:
                while True:
                    j = c.get(f"/sdcpp/v1/jobs/{jid}").json()
                    if j["status"] in ("completed", "failed", "cancelled"):
                        with lock:
                            finals[jid] = j["status"]
                        break
                    time.sleep(0.05)

    def raw(payload: bytes, hold: float = 0.0, read=False):
        s = socket.create_connection(("127.0.0.1", port), timeout=10)
        try:
            s.sendall(payload)
            time.sleep(hold)
            return s.recv(4096) if read else b""
        finally:
            s.close()

    def faults():
        n = 0
        while time.time() < stop:
            body = json.dumps({"prompt": "leaver", "size": "64x64"}).encode()
            # a client that disconnects mid-job
            raw(b"POST /v1/images/generations HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % len(body) + body, hold=0.3)
            # a huge declared body: 413 at once, nothing read
            ans = raw(b"POST /sdcpp/v1/img_gen HTTP/1.1\r\nHost: x\r\nContent-Length: 500000000\r\n\r\n{", read=True)
            assert b" 413 " in ans.split(b"\r\n", 1)[0], ans[:200]
            # a huge chunked body (no length): cut off at the limit
            chunk = b"x" * 65536
            req = b"POST /sdcpp/v1/img_gen HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
            req += (b"%x\r\n" % len(chunk) + chunk + b"\r\n") * 20 + b"0\r\n\r\n"
            ans = raw(req, read=True)
            assert b" 413 " in ans.split(b"\r\n", 1)[0], ans[:200]
            n += 1
        return n

    def slowloris(socks):
        # connections that send their headers a byte at a time, forever (until the run ends)
        for _ in range(20):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            s.sendall(b"POST /sdcpp/v1/img_gen HTTP/1.1\r\n")
            socks.append(s)
        while time.time() < stop:
            for s in socks:
                try:
                    s.send(b"X")
                except OSError:
                    pass
            time.sleep(1.0)

    # warm-up, then the baseline RSS
    with httpx.Client(base_url=url, timeout=60) as c:
        for _ in range(3):
            assert c.post("/v1/images/generations", json={"prompt": "warm", "size": "64x64"}).status_code == 200
    rss0 = rss_kib(proc.pid)
    socks = []
    threads = [threading.Thread(target=burst)] + [threading.Thread(target=client, args=(i,)) for i in range(CLIENTS)]
    fault_n = []
    threads.append(threading.Thread(target=lambda: fault_n.append(faults())))
    threads.append(threading.Thread(target=slowloris, args=(socks,)))
    t_start = time.time()
    for t in threads:
        t.start()
    samples = []
    while any(t.is_alive() for t in threads):
        samples.append(rss_kib(proc.pid))
        # the server answers while loaded
        assert httpx.get(url + "/sdapi/v1/progress", timeout=10).status_code == 200
        time.sleep(1.0)
    for t in threads:
        t.join()
    for s in socks:
        s.close()
    wall = time.time() - t_start
    time.sleep(6)                                    # past --job-ttl: finished jobs dropped
    rss1 = rss_kib(proc.pid)
    snap = httpx.get(url + "/sdcpp/v1/queue", timeout=10).json()
    print(f"\nload: {CLIENTS} clients, {wall:.1f}s, statuses {dict(sorted(statuses.items()))}, "
          f"accepted async jobs {len(accepted)}, finals {len(finals)}, fault rounds {fault_n}, "
          f"max pending {max_pending_seen[0]} (limit {MAX_QUEUE}), server counts {snap['counts']}, "
          f"RSS warm {rss0 // 1024} MiB, peak {max(samples) // 1024} MiB, after {rss1 // 1024} MiB")
    assert not errors, errors[:5]
    assert proc.poll() is None
    assert statuses.get(429, 0) > 0, "the queue limit was never reached"
    assert max_pending_seen[0] <= MAX_QUEUE
    assert sorted(finals) == sorted(accepted) and len(set(accepted)) == len(accepted)    # none lost or duplicated
    assert snap["current"] is None and snap["queued"] == []
    c = snap["counts"]
    assert c["submitted"] == c.get("completed", 0) + c.get("cancelled", 0) + c.get("failed", 0)
    assert c.get("failed", 0) == 0
    assert rss1 - rss0 < 64 * 1024, (rss0, rss1)     # flat: < 64 MiB drift after warm-up


def test_sigterm_answers_waiting_clients(tmp_path):
    """SIGTERM with one job running, more queued and a synchronous client waiting on a queued one:
    the waiting client gets a JSON 503, the queued jobs end 'cancelled' (server_shutdown), the
    process exits (by the SIGTERM uvicorn re-raises after its clean shutdown)."""
    import signal
    ckpt = write_tiny_sd1(tmp_path / "tiny-sd1.safetensors")
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    proc = subprocess.Popen([sys.executable, "-m", "sdrt.cli.main", "serve", "-m", ckpt, "--listen-port", str(port),
                             "-W", "64", "-H", "64", "--steps", "30", "-t", "1", "--log-level", "warn"],
                            env=dict(os.environ, PYTHONPATH=ROOT), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    try:
        t0 = time.time()
        while time.time() - t0 < 120:
            try:
                httpx.get(url + "/v1/models", timeout=2)
                break
            except httpx.TransportError:
                time.sleep(0.2)
        ids = [httpx.post(url + "/sdcpp/v1/img_gen", json={"prompt": "x"}).json()["id"] for _ in range(3)]
        answer = {}
        t = threading.Thread(target=lambda: answer.update(r=httpx.post(url + "/v1/images/generations",
                                                                      json={"prompt": "y"}, timeout=120)))
        t.start()
        while httpx.get(url + f"/sdcpp/v1/jobs/{ids[0]}").json()["status"] != "generating":
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)
        t.join(120)
        r = answer["r"]
        assert r.status_code == 503 and r.json()["code"] == "server_shutdown"
        assert proc.wait(120) in (0, -signal.SIGTERM)      # uvicorn re-raises the signal it handled
    finally:
        if proc.poll() is None:
            proc.kill()
