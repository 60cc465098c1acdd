"""The server's point: a loaded model makes later images fast. Measures, for one image:

  cli     the whole `sdrt` process (python -m sdrt.cli.main ... -o out.png), start to exit
  first   the first request to a freshly started `sdrt serve` (after the port opens)
  second  the second identical request (seed + 1) to the same server

and prints the ratio second / cli (issue 17's target on the H200: SDXL 1024x1024, 20 steps,
second <= 0.6x cli).

    python bench/bench_server.py -m /work/models/sd_xl_base_1.0.safetensors -W 1024 -H 1024 --steps 20 \
        --extra "--backend cuda0"
    python bench/bench_server.py --tiny          # a tiny random SD1 checkpoint, CPU: a smoke run

Every extra flag (--extra "...") goes to both the CLI and the server, so they load the same way."""
from __future__ import annotations

import argparse
import base64
import json
import os
import shlex
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def post(url, body, timeout=3600):
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def free_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    p = s.getsockname()[1]
    s.close()
    return p


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("-m", "--model")
    ap.add_argument("--tiny", action="store_true", help="write and use a tiny random SD1 checkpoint")
    ap.add_argument("-W", "--width", type=int, default=512)
    ap.add_argument("-H", "--height", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("-p", "--prompt", default="a lovely cat")
    ap.add_argument("--extra", default="", help="more flags for both the CLI and the server")
    a = ap.parse_args()
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
    tmp = tempfile.mkdtemp(prefix="bench_server_")
    if a.tiny:
        sys.path.insert(0, os.path.join(ROOT, "tests"))
        sys.path.insert(0, ROOT)
        from test_server_tiny import write_tiny_sd1
        a.model = write_tiny_sd1(os.path.join(tmp, "tiny-sd1.safetensors"))
        a.width, a.height, a.steps = 64, 64, 2
    if not a.model:
        ap.error("give -m MODEL or --tiny")
    common = ["-m", a.model, "-W", str(a.width), "-H", str(a.height), "--steps", str(a.steps),
              "-p", a.prompt, "--log-level", "warn"] + shlex.split(a.extra)

    # the CLI: one whole process per image
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-m", "sdrt.cli.main", *common, "-s", "42", "-o", os.path.join(tmp, "cli.png")],
                   env=env, check=True)
    t_cli = time.perf_counter() - t0

    # the server: started, then two requests
    port = free_port()
    t0 = time.perf_counter()
    proc = subprocess.Popen([sys.executable, "-m", "sdrt.cli.main", "serve", *common, "--listen-port", str(port)],
                            env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        while True:
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=2).read()
                break
            except OSError:
                if proc.poll() is not None:
                    raise SystemExit("the server exited")
                time.sleep(0.2)
        t_up = time.perf_counter() - t0
        times = []
        for seed in (42, 43):
            t0 = time.perf_counter()
            d = post(url + "/sdapi/v1/txt2img", {"prompt": a.prompt, "width": a.width, "height": a.height,
                                                 "steps": a.steps, "seed": seed})
            times.append(time.perf_counter() - t0)
            assert base64.b64decode(d["images"][0])[:4] == b"\x89PNG"
    finally:
        proc.terminate()
        proc.wait(60)
    print(f"model {os.path.basename(a.model)} {a.width}x{a.height} {a.steps} steps  extra: {a.extra or '-'}")
    print(f"cli whole process      {t_cli:8.2f} s")
    print(f"server start to ready  {t_up:8.2f} s")
    print(f"server first request   {times[0]:8.2f} s")
    print(f"server second request  {times[1]:8.2f} s   second / cli = {times[1] / t_cli:.2f} (target <= 0.6)")


if __name__ == "__main__":
    main()
