"""Make the sampling goldens (tests/fixtures/sampling_*.npz) from stable-diffusion.cpp itself.

    python tools/make_sampling_goldens.py --sdcpp /path/to/stable-diffusion.cpp [--ggml-include DIR]

What it does:

1. Writes a small C++ harness (below) that ``#include``s sd.cpp's own ``runtime/denoiser.hpp``,
   ``core/rng_philox.hpp`` and ``core/rng_mt19937.hpp`` unchanged (a stub replaces only
   ``core/ggml_extend.hpp``: logging macros and the includes the header needs) and compiles it
   with ``g++ -O3`` and no ``-march``, as sd.cpp's CMake builds its library. The stub does not
   include ``<math.h>``, so unqualified ``log``/``exp`` on floats resolve to C's double functions
   exactly as in sd.cpp's real translation unit (checked with ``g++ -E`` on
   ``src/stable-diffusion.cpp``).
2. Asks it for: RNG sequences (cuda/Philox, cpu/mt19937 port, std_default) over several calls;
   the sigmas of every scheduler for eps / edm_v / sd3_flow / flux_flow denoisers and several
   step counts, model families, token counts and extra args; and the final latent of every
   sampler on a toy denoiser ``pred = x * ka/(sigma^2 + ka) + b`` (``uncond`` likewise with kb,
   c), plus the (sigma, step) of every model call.
3. Records torch's own ``torch.randn`` (CPU) for the ``cpu`` RNG's torch flavour (needs torch;
   ``--no-torch`` skips it).

The sd.cpp source needs ``src/``, ``include/`` and ggml's ``include/`` (the ggml submodule, or
``--ggml-include``). The goldens were made from leejet/stable-diffusion.cpp 97d29908 with g++ 12.2
(Debian glibc 2.36) and torch 2.13.0+cpu. Tests read only the .npz files (no torch, no compiler).
"""

import argparse
import os
import subprocess
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures")
sys.path.insert(0, ROOT)

STUB = r"""// Minimal stand-in for sd.cpp's core/ggml_extend.hpp: just what runtime/denoiser.hpp needs.
#pragma once
#include <cstdio>
#include <cstring>
#include <cstdlib>
#include <algorithm>
#include <array>
#include <functional>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <vector>
#include "core/tensor.hpp"
#include "model.h"
#include "core/util.h"
#define LOG_DEBUG(...) do {} while (0)
#define LOG_INFO(...) do {} while (0)
#define LOG_WARN(...) do {} while (0)
#define LOG_ERROR(...) do { fprintf(stderr, __VA_ARGS__); fprintf(stderr, "\n"); } while (0)
#ifndef GGML_ASSERT
#define GGML_ASSERT(x) do { if (!(x)) { fprintf(stderr, "assert %s\n", #x); abort(); } } while (0)
#endif
#define SD_UNUSED(x) (void)(x)
"""

HARNESS = r"""// Golden generator: runs stable-diffusion.cpp's own RNG, scheduler and sampler code.
#include "runtime/denoiser.hpp"
#include "core/rng_mt19937.hpp"
#include "core/rng_philox.hpp"
#include <cstdio>
#include <sstream>

extern "C" void ggml_abort(const char* file, int line, const char* fmt, ...) { fprintf(stderr, "ggml_abort %s:%d\n", file, line); abort(); }

std::string trim(const std::string& s) {
    size_t a = s.find_first_not_of(" \t\n\r\f\v");
    if (a == std::string::npos) return "";
    size_t b = s.find_last_not_of(" \t\n\r\f\v");
    return s.substr(a, b - a + 1);
}
KeyValueArgs parse_key_value_args(const char* args, const char* context) {
    KeyValueArgs pairs;
    if (args == nullptr || args[0] == '\0') return pairs;
    std::string raw(args);
    size_t start = 0;
    for (size_t pos = 0; pos <= raw.size(); ++pos) {
        if (pos != raw.size() && raw[pos] != ',' && raw[pos] != ';') continue;
        std::string token = trim(raw.substr(start, pos - start));
        if (!token.empty()) {
            size_t eq = token.find('=');
            if (eq != std::string::npos) pairs.emplace_back(trim(token.substr(0, eq)), trim(token.substr(eq + 1)));
        }
        start = pos + 1;
    }
    return pairs;
}
KeyValueArgs parse_key_value_args(const std::string& args, const char* context) { return parse_key_value_args(args.c_str(), context); }
bool parse_strict_float(const std::string& text, float& value) {
    try { size_t c = 0; float p = std::stof(text, &c); if (!trim(text.substr(c)).empty()) return false; value = p; return true; } catch (...) { return false; }
}
bool parse_strict_int(const std::string& text, int& value) {
    try { size_t c = 0; int p = std::stoi(text, &c); if (!trim(text.substr(c)).empty()) return false; value = p; return true; } catch (...) { return false; }
}
bool parse_strict_bool(const std::string& text, bool& value) {
    std::string l = trim(text);
    std::transform(l.begin(), l.end(), l.begin(), [](unsigned char c) { return (char)std::tolower(c); });
    if (l == "1" || l == "true" || l == "yes" || l == "on") { value = true; return true; }
    if (l == "0" || l == "false" || l == "no" || l == "off") { value = false; return true; }
    return false;
}

// protocol: commands on stdin, one per line; results as "name n v0 v1 ..." with %a hex floats
static void emit(const std::string& name, const std::vector<float>& v) {
    printf("%s %zu", name.c_str(), v.size());
    for (float f : v) printf(" %a", f);
    printf("\n");
}

static std::shared_ptr<RNG> make_rng(const std::string& kind) {
    if (kind == "cuda") return std::make_shared<PhiloxRNG>();
    if (kind == "cpu") return std::make_shared<MT19937RNG>();
    return std::make_shared<STDDefaultRNG>();
}

static std::shared_ptr<Denoiser> make_denoiser(const std::string& pred, float shift) {
    std::shared_ptr<Denoiser> d;
    if (pred == "eps") d = std::make_shared<CompVisDenoiser>();
    else if (pred == "v") d = std::make_shared<CompVisVDenoiser>();
    else if (pred == "edm_v") d = std::make_shared<EDMVDenoiser>();
    else if (pred == "sd3_flow") { auto f = std::make_shared<DiscreteFlowDenoiser>(); f->set_shift(shift); d = f; }
    else if (pred == "flux_flow") { auto f = std::make_shared<FluxFlowDenoiser>(); f->set_shift(shift); d = f; }
    if (auto cv = std::dynamic_pointer_cast<CompVisDenoiser>(d)) {
        // stable-diffusion.cpp: calculate_alphas_cumprod + refresh_compvis_denoiser_sigmas
        float ls_sqrt = sqrtf(0.00085f), le_sqrt = sqrtf(0.0120f), amount = le_sqrt - ls_sqrt, product = 1.0f;
        for (int i = 0; i < TIMESTEPS; i++) {
            float beta = ls_sqrt + amount * ((float)i / (TIMESTEPS - 1));
            product *= 1.0f - powf(beta, 2.0f);
            cv->sigmas[i]     = std::sqrt((1 - product) / product);
            cv->log_sigmas[i] = std::log(cv->sigmas[i]);
        }
    }
    return d;
}

static scheduler_t sched_of(const std::string& s) {
    const char* names[] = {"discrete", "karras", "exponential", "ays", "gits", "sgm_uniform", "simple", "smoothstep",
                           "kl_optimal", "lcm", "bong_tangent", "ltx2", "logit_normal", "flux2", "flux", "beta"};
    for (int i = 0; i < SCHEDULER_COUNT; i++) if (s == names[i]) return (scheduler_t)i;
    return SCHEDULER_COUNT;
}
static sample_method_t method_of(const std::string& s) {
    const char* names[] = {"euler", "euler_a", "heun", "dpm2", "dpm++2s_a", "dpm++2m", "dpm++2mv2", "ipndm", "ipndm_v",
                           "lcm", "ddim_trailing", "tcd", "res_multistep", "res_2s", "er_sde", "euler_cfg_pp",
                           "euler_a_cfg_pp", "euler_ge", "dpm++2m_sde", "dpm++2m_sde_bt", "lms"};
    for (int i = 0; i < SAMPLE_METHOD_COUNT; i++) if (s == names[i]) return (sample_method_t)i;
    return SAMPLE_METHOD_COUNT;
}
static SDVersion version_of(const std::string& v) {
    if (v == "sdxl") return VERSION_SDXL;
    if (v == "svd") return VERSION_SVD;
    if (v == "sd2") return VERSION_SD2;
    return VERSION_SD1;
}

int main() {
    std::string line;
    while (std::getline(std::cin, line)) {
        std::istringstream in(line);
        std::string cmd, tag;
        in >> cmd >> tag;
        if (cmd == "rng") {  // rng TAG kind seed n1 n2 ...
            std::string kind; uint64_t seed; in >> kind >> seed;
            auto r = make_rng(kind); r->manual_seed(seed);
            std::vector<float> all; uint32_t n;
            while (in >> n) { auto v = r->randn(n); all.insert(all.end(), v.begin(), v.end()); }
            emit(tag, all);
        } else if (cmd == "sched") {  // sched TAG pred shift scheduler n version seqlen [extra]
            std::string pred, sch, ver, extra; float shift; uint32_t n; int seq;
            in >> pred >> shift >> sch >> n >> ver >> seq; std::getline(in, extra); extra = trim(extra);
            auto d = make_denoiser(pred, shift);
            emit(tag, d->get_sigmas(n, seq, sched_of(sch), version_of(ver), extra.empty() ? nullptr : extra.c_str()));
        } else if (cmd == "sample") {
            // sample TAG method eta is_flow rngkind seed ka kb nsig s0.. nx x0.. nb b0.. nc c0.. [extra]
            std::string method, rk, extra; float eta, ka, kb; int is_flow; uint64_t seed; size_t ns, nx, nb, nc;
            in >> method >> eta >> is_flow >> rk >> seed >> ka >> kb >> ns;
            std::vector<float> sig(ns); for (auto& v : sig) { std::string t; in >> t; v = strtof(t.c_str(), nullptr); }
            in >> nx; std::vector<float> xv(nx); for (auto& v : xv) { std::string t; in >> t; v = strtof(t.c_str(), nullptr); }
            in >> nb; std::vector<float> bv(nb); for (auto& v : bv) { std::string t; in >> t; v = strtof(t.c_str(), nullptr); }
            in >> nc; std::vector<float> cv(nc); for (auto& v : cv) { std::string t; in >> t; v = strtof(t.c_str(), nullptr); }
            std::getline(in, extra); extra = trim(extra);
            auto r = make_rng(rk); r->manual_seed(seed);
            sd::Tensor<float> x({(int64_t)nx}, xv);
            sd::Tensor<float> bt({(int64_t)nx}, bv), ct({(int64_t)nx}, cv);
            std::vector<float> calls;
            // toy denoiser: pred = x * (ka / (sigma^2 + ka)) + b ; uncond = x * (kb / (sigma^2 + kb)) + c
            denoise_cb_t model = [&](const sd::Tensor<float>& xx, float sigma, int step) {
                sd::guidance::GuiderOutput o;
                float k1 = ka / (sigma * sigma + ka), k2 = kb / (sigma * sigma + kb);
                o.pred        = xx * k1 + bt;
                o.pred_uncond = xx * k2 + ct;
                calls.push_back(sigma); calls.push_back((float)step);
                return o;
            };
            auto out = sample_k_diffusion(method_of(method), model, x, sig, r, eta, is_flow != 0, extra.empty() ? nullptr : extra.c_str());
            emit(tag, out.empty() ? std::vector<float>{} : std::vector<float>(out.data(), out.data() + out.numel()));
            emit(tag + "__calls", calls);
        }
        fflush(stdout);
    }
    return 0;
}
"""

SAMPLERS = ["euler", "euler_a", "heun", "dpm2", "dpm++2s_a", "dpm++2m", "dpm++2mv2", "ipndm", "ipndm_v",
            "lcm", "ddim_trailing", "tcd", "res_multistep", "res_2s", "er_sde", "euler_cfg_pp",
            "euler_a_cfg_pp", "euler_ge", "dpm++2m_sde", "dpm++2m_sde_bt", "lms"]
DEFAULT_ETA = {"euler_a": 1.0, "dpm++2s_a": 1.0, "er_sde": 1.0, "euler_a_cfg_pp": 1.0,
               "dpm++2m_sde": 1.0, "dpm++2m_sde_bt": 1.0}
SCHEDULERS = ["discrete", "karras", "exponential", "ays", "gits", "sgm_uniform", "simple", "smoothstep",
              "kl_optimal", "lcm", "bong_tangent", "ltx2", "logit_normal", "flux2", "flux", "beta"]
FLOW_ONLY = {"ltx2", "logit_normal", "flux2", "flux"}

# toy denoiser constants (also in tests/test_samplers.py)
KA, KB = 1.7, 0.6


def build(sdcpp, ggml_include, work):
    os.makedirs(os.path.join(work, "stub", "core"), exist_ok=True)
    with open(os.path.join(work, "stub", "core", "ggml_extend.hpp"), "w") as f:
        f.write(STUB)
    with open(os.path.join(work, "harness.cpp"), "w") as f:
        f.write(HARNESS)
    exe = os.path.join(work, "harness")
    cmd = ["g++", "-std=c++17", "-O3", "-DNDEBUG", "-w", "-I" + os.path.join(work, "stub"),
           "-I" + os.path.join(sdcpp, "src"), "-I" + os.path.join(sdcpp, "include"), "-I" + ggml_include,
           "-I" + os.path.join(sdcpp, "thirdparty"), "-I" + sdcpp, os.path.join(work, "harness.cpp"), "-o", exe]
    subprocess.run(cmd, check=True)
    return exe


def run(exe, lines):
    out = subprocess.run([exe], input="\n".join(lines) + "\n", capture_output=True, text=True, check=True).stdout
    res = {}
    for ln in out.splitlines():
        parts = ln.split()
        res[parts[0]] = np.array([float.fromhex(v) for v in parts[2:]], np.float32)
        assert len(res[parts[0]]) == int(parts[1])
    return res


def hexs(a):
    return " ".join(float(v).hex() for v in np.asarray(a, np.float32))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sdcpp", required=True, help="stable-diffusion.cpp source tree")
    ap.add_argument("--ggml-include", help="ggml include dir (default: SDCPP/ggml/include)")
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--out", default=FIX)
    args = ap.parse_args()
    ggml_inc = args.ggml_include or os.path.join(args.sdcpp, "ggml", "include")
    os.makedirs(args.out, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        exe = build(args.sdcpp, ggml_inc, work)

        # ---- RNGs
        calls = {"a": [1, 3, 16, 17, 5, 100, 4099], "b": [8, 15, 33, 2, 64, 7]}
        lines, meta = [], {}
        for kind in ("cuda", "cpu", "std_default"):
            for seed in (0, 42, 4294967297 + 6, 1234567):
                for cname, ns in calls.items():
                    tag = f"rng__{kind}__{seed}__{cname}"
                    lines.append(f"rng {tag} {kind} {seed} " + " ".join(map(str, ns)))
                    meta[tag + "__calls"] = np.array(ns, np.int64)
        rng = run(exe, lines)
        rng.update(meta)
        if not args.no_torch:
            import torch
            for seed in (0, 42, 4294967297 + 6, 1234567):
                for cname, ns in calls.items():
                    torch.manual_seed(seed)
                    rng[f"torch__{seed}__{cname}"] = np.concatenate([torch.randn(n).numpy() for n in ns])
            rng["torch_version"] = np.array(torch.__version__)
        np.savez_compressed(os.path.join(args.out, "sampling_rng.npz"), **rng)

        # ---- schedulers
        lines = []
        dens = [("eps", 0.0), ("edm_v", 0.0), ("sd3_flow", 3.0), ("flux_flow", 1.15)]
        steps = [1, 2, 3, 4, 6, 10, 11, 20, 21, 30]
        for pred, shift in dens:
            for sch in SCHEDULERS:
                if sch in FLOW_ONLY and pred != "sd3_flow":
                    continue
                for n in steps:
                    if sch == "gits" and n < 2:
                        continue
                    vers = ["sd1", "sdxl", "svd"] if sch == "ays" else ["sd1"]
                    seqs = [0, 256, 1024, 4096, 5000] if sch in FLOW_ONLY else [0]
                    extras = [""]
                    if sch == "beta":
                        extras.append("alpha=0.5, beta=0.7")
                    if sch == "flux":
                        extras.append("base_shift=0.6;max_shift=1.3")
                    if sch == "ltx2":
                        extras += ["stretch=false", "terminal=0.05,max_shift=1.8"]
                    if sch == "logit_normal":
                        extras += ["mu=0.3,std=1.2,resolution_aware=0", "logsnr_min=-10,logsnr_max=12"]
                    for ver in vers:
                        for seq in seqs:
                            for ei, ex in enumerate(extras):
                                tag = f"sched__{pred}__{sch}__{n}__{ver}__{seq}__{ei}"
                                lines.append(f"sched {tag} {pred} {shift} {sch} {n} {ver} {seq} {ex}".rstrip())
        sch = run(exe, lines)
        # one packed table: case i is values[offsets[i]:offsets[i + 1]]
        keys, extras, vals, offs = [], [], [], [0]
        for ln in lines:
            parts = ln.split(" ", 8)  # sched TAG pred shift scheduler n version seqlen [extra]
            keys.append(parts[1])
            extras.append(parts[8] if len(parts) > 8 else "")
            vals.append(sch[parts[1]])
            offs.append(offs[-1] + len(sch[parts[1]]))
        np.savez_compressed(os.path.join(args.out, "sampling_schedulers.npz"), keys=np.array(keys),
                            extras=np.array(extras), offsets=np.array(offs, np.int64),
                            values=np.concatenate(vals).astype(np.float32))

        # ---- samplers on a toy denoiser
        g = np.random.default_rng(20260829)
        n = 64
        x_eps = (g.standard_normal(n) * 14.6).astype(np.float32)
        x_flow = g.standard_normal(n).astype(np.float32)
        b = (g.standard_normal(n) * 0.5).astype(np.float32)
        c = (g.standard_normal(n) * 0.5).astype(np.float32)
        sig_eps = sch["sched__eps__discrete__6__sd1__0__0"]
        sig_flow = sch["sched__sd3_flow__discrete__6__sd1__0__0"]
        sig_lcm = sch["sched__eps__lcm__6__sd1__0__0"]
        sig_simple = sch["sched__eps__simple__6__sd1__0__0"]
        cases = []
        for m in SAMPLERS:
            sig = sig_lcm if m in ("lcm", "tcd") else sig_simple if m == "ddim_trailing" else sig_eps
            cases.append((m, DEFAULT_ETA.get(m, 0.0), 0, "cuda", 42, sig, x_eps, ""))
        for m in ("euler_a", "dpm++2s_a", "res_multistep", "res_2s", "er_sde", "euler_a_cfg_pp", "dpm++2m_sde",
                  "dpm++2m_sde_bt", "euler_ge", "ddim_trailing", "tcd"):
            cases.append((m, 0.5, 0, "cuda", 7, sig_lcm if m == "tcd" else sig_eps, x_eps, ""))
        for rk in ("cpu", "std_default"):
            for m in ("euler_a", "dpm++2m_sde", "dpm++2m_sde_bt", "lcm"):
                cases.append((m, DEFAULT_ETA.get(m, 0.0), 0, rk, 3, sig_lcm if m == "lcm" else sig_eps, x_eps, ""))
        for m, eta in (("euler", 0.0), ("euler_a", 1.0), ("euler_a", 0.6), ("dpm++2s_a", 1.0), ("dpm++2s_a", 0.5),
                       ("lcm", 0.0), ("res_multistep", 0.5), ("res_2s", 0.5), ("er_sde", 1.0), ("euler_ge", 0.5),
                       ("dpm++2m", 0.0), ("ipndm", 0.0), ("heun", 0.0)):
            cases.append((m, eta, 1, "cuda", 11, sig_flow, x_flow, ""))
        cases += [("lms", 0.0, 0, "cuda", 1, sig_eps, x_eps, "lms_max_order=3,lms_shift=0"),
                  ("lms", 0.0, 0, "cuda", 1, sig_eps, x_eps, "lms_max_order=6, lms_divisions=50"),
                  ("lcm", 0.0, 0, "cuda", 5, sig_lcm, x_eps, "noise_clip_std=1.5,noise_scale_start=0.8"),
                  ("lcm", 0.0, 0, "cuda", 5, sig_lcm, x_eps, "noise_scale_start=1.2,noise_scale_end=0.4"),
                  ("euler_ge", 0.0, 0, "cuda", 1, sig_eps, x_eps, "gamma=1.5")]
        lines, out = [], {"x_eps": x_eps, "x_flow": x_flow, "b": b, "c": c, "ka": np.float32(KA), "kb": np.float32(KB)}
        for k, (m, eta, fl, rk, seed, sig, x0, ex) in enumerate(cases):
            tag = f"case{k:03d}"
            lines.append(f"sample {tag} {m} {eta} {fl} {rk} {seed} {KA} {KB} {len(sig)} {hexs(sig)} {n} {hexs(x0)} "
                         f"{n} {hexs(b)} {n} {hexs(c)} {ex}".rstrip())
            out[tag + "__meta"] = np.array([m, repr(eta), str(fl), rk, str(seed), ex])
            out[tag + "__sigmas"] = np.asarray(sig, np.float32)
            out[tag + "__x0"] = "x_flow" if fl else "x_eps"
        res = run(exe, lines)
        for k in list(out):
            if k.endswith("__x0"):
                out[k] = np.array(out[k])
        out.update(res)
        np.savez_compressed(os.path.join(args.out, "sampling_samplers.npz"), **out)
    print("wrote", os.path.join(args.out, "sampling_{rng,schedulers,samplers}.npz"))


if __name__ == "__main__":
    main()
