"""Write the VAE / TAE goldens (tests/fixtures/vae_*.npz) the VAE tests compare against; the
tests never import torch.

    python tools/make_vae_goldens.py --taesd /path/to/taesd.py [--shared ../shared]

Needs torch, diffusers and Pillow; `--taesd` is madebyollin/taesd's taesd.py (MIT; the reference
for TAEF2's GroupNorm mid blocks — not part of this repo; provenance below).

Weights are not stored: `make_weights(spec, seed)` (numpy only, importable by the tests) draws
them from numpy's frozen RandomState stream, rounded to float16 values, in the order of
`spec` (LDM/checkpoint names and torch shapes, stored in the fixture as JSON). The torch models
get exactly these values, so sdrt and PyTorch run the same weights.

Fixtures
- vae_kl.npz: diffusers AutoencoderKL, tiny random configs (cases `g32`, `g8`, `noquant`, see
  KL_CASES), names converted to LDM with sdrt.models.names.diffusers_vae_to_ldm (mid attention kept
  as [C, C] linears, as diffusers stores them). Per case: `{c}_spec`, `{c}_x` image [1,3,32,32]
  in [-1,1], `{c}_moments` = quant_conv(encoder(x)), `{c}_noise`, `{c}_sample` = diffusers'
  DiagonalGaussianDistribution mean + std * noise, `{c}_z` [2,C,16,16], `{c}_dec` = decode(z).
- vae_tae.npz: diffusers AutoencoderTiny with 8 channels (`tiny_*`, diffusers layout
  decoder.layers.N / encoder.layers.N; the raw layers on [0, 1] images), and a TAEF2-shaped
  tiny model (8 channels, 32 latent channels, GroupNorm mid blocks) assembled from taesd.py's
  own conv/Block/Clamp in its Encoder()/Decoder() order (`f2_*`, taesd.py layout: bare N.*,
  decoder shifted by the Clamp), with `f2_zp` = the latent patchified as diffusers' Flux2
  pipeline does (view(B, C, H/2, 2, W/2, 2).permute(0, 1, 3, 5, 2, 4)).
- vae_taef2_real.npz (needs ../shared): taesd.py TAESD(taef2_encoder.pth, taef2_decoder.pth) on
  cat_1024.png resized to 512x512 with Pillow LANCZOS: `latent` [1,32,64,64], `crop` = decoded
  image [:, :, 192:320, 192:320], `psnr` of the clamped decode against the input.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FIX = os.path.join(ROOT, "tests", "fixtures")
TAESD_COMMIT = "5cccb12 (madebyollin/taesd: Add support for FLUX.2 VAE)"

KL_CASES = {
    # name: (diffusers AutoencoderKL kwargs, seed)
    "g32": (dict(block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=32, latent_channels=4), 11),
    "g8": (dict(block_out_channels=(32, 64), layers_per_block=1, norm_num_groups=8, latent_channels=4), 12),
    "noquant": (dict(block_out_channels=(16, 32), layers_per_block=2, norm_num_groups=8, latent_channels=16,
                     use_quant_conv=False, use_post_quant_conv=False), 13),
}


def make_weights(spec, seed: int) -> dict[str, np.ndarray]:
    """name -> float32 array, from spec [(name, torch shape), ...]: conv/linear weights
    N(0, 1/fan_in), norm weights 1 + 0.1 N, biases 0.1 N; every value float16-exact."""
    rs = np.random.RandomState(seed)
    out = {}
    for name, shape in spec:
        shape = tuple(shape)
        v = rs.standard_normal(int(np.prod(shape))).reshape(shape)
        if len(shape) >= 2:
            v = v / np.sqrt(np.prod(shape[1:]))
        elif "norm" in name and name.endswith("weight"):
            v = 1.0 + 0.1 * v
        else:
            v = 0.1 * v
        out[name] = v.astype(np.float16).astype(np.float32)
    return out


def _spec_json(spec) -> np.ndarray:
    return np.array(json.dumps([[n, list(s)] for n, s in spec]))


def _load(model, weights: dict, name_of):
    import torch
    sd = model.state_dict()
    new = {k: torch.from_numpy(weights[name_of(k)].reshape(tuple(v.shape))) for k, v in sd.items()}
    model.load_state_dict(new)


def kl_goldens():
    import diffusers
    import torch
    from diffusers import AutoencoderKL

    sys.path.insert(0, ROOT)
    from sdrt.models.names import diffusers_vae_to_ldm
    out = {"provenance": np.array(f"torch {torch.__version__}, diffusers {diffusers.__version__}; "
                                  f"configs {json.dumps({k: v[0] for k, v in KL_CASES.items()})}")}
    for case, (kw, seed) in KL_CASES.items():
        n = len(kw["block_out_channels"])
        model = AutoencoderKL(in_channels=3, out_channels=3, down_block_types=("DownEncoderBlock2D",) * n,
                              up_block_types=("UpDecoderBlock2D",) * n, sample_size=32, **kw).eval()
        conv = {k: "first_stage_model." + diffusers_vae_to_ldm(k, n) for k in model.state_dict()}
        spec = [(conv[k], tuple(v.shape)) for k, v in model.state_dict().items()]
        weights = make_weights(spec, seed)
        _load(model, weights, conv.get)
        rs = np.random.RandomState(seed + 100)
        x = rs.uniform(-1, 1, (1, 3, 32, 32)).astype(np.float32)
        C = kw["latent_channels"]
        s = 32 // 2 ** (n - 1)
        z = rs.standard_normal((2, C, s, s)).astype(np.float32)
        noise = rs.standard_normal((1, C) + z.shape[2:]).astype(np.float32)
        with torch.no_grad():
            h = model.encoder(torch.from_numpy(x))
            moments = model.quant_conv(h) if model.quant_conv is not None else h
            dist = diffusers.models.autoencoders.vae.DiagonalGaussianDistribution(moments)
            sample = dist.mean + dist.std * torch.from_numpy(noise)
            dec = model.decode(torch.from_numpy(z)).sample
        out.update({f"{case}_spec": _spec_json(spec), f"{case}_seed": np.array(seed), f"{case}_x": x,
                    f"{case}_moments": moments.numpy(), f"{case}_noise": noise, f"{case}_sample": sample.numpy(),
                    f"{case}_z": z, f"{case}_dec": dec.numpy()})
        print(f"{case}: {sum(int(np.prod(s)) for _, s in spec)} params, |dec| max {np.abs(dec.numpy()).max():.3f}")
    np.savez_compressed(os.path.join(FIX, "vae_kl.npz"), **out)


def _taesd_module(path):
    spec = importlib.util.spec_from_file_location("taesd_ref", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def tae_goldens(taesd_path):
    import diffusers
    import torch
    from diffusers import AutoencoderTiny

    out = {"provenance": np.array(f"torch {torch.__version__}, diffusers {diffusers.__version__}, "
                                  f"taesd.py at {TAESD_COMMIT}")}
    # diffusers AutoencoderTiny, 8 channels, 4 latent channels
    model = AutoencoderTiny(encoder_block_out_channels=(8,) * 4, decoder_block_out_channels=(8,) * 4,
                            latent_channels=4).eval()
    spec = [(k, tuple(v.shape)) for k, v in model.state_dict().items()]
    weights = make_weights(spec, 21)
    _load(model, weights, lambda k: k)
    rs = np.random.RandomState(121)
    x = rs.uniform(0, 1, (1, 3, 32, 32)).astype(np.float32)
    z = (2 * rs.standard_normal((2, 4, 4, 4))).astype(np.float32)
    with torch.no_grad():
        lat = model.encoder.layers(torch.from_numpy(x))          # raw layers: [0, 1] images
        dec = model.decoder.layers(torch.tanh(torch.from_numpy(z) / 3) * 3)
    out.update(tiny_spec=_spec_json(spec), tiny_seed=np.array(21), tiny_x=x, tiny_lat=lat.numpy(), tiny_z=z,
               tiny_dec=dec.numpy())

    # TAEF2-shaped: taesd.py's blocks, 8 channels, 32 latent channels, GroupNorm mid blocks
    t = _taesd_module(taesd_path)
    c, zc, gn = 8, 32, dict(use_midblock_gn=True)
    enc = torch.nn.Sequential(
        t.conv(3, c), t.Block(c, c),
        t.conv(c, c, stride=2, bias=False), t.Block(c, c), t.Block(c, c), t.Block(c, c),
        t.conv(c, c, stride=2, bias=False), t.Block(c, c), t.Block(c, c), t.Block(c, c),
        t.conv(c, c, stride=2, bias=False), t.Block(c, c, **gn), t.Block(c, c, **gn), t.Block(c, c, **gn),
        t.conv(c, zc)).eval()
    dec = torch.nn.Sequential(
        t.Clamp(), t.conv(zc, c), torch.nn.ReLU(),
        t.Block(c, c, **gn), t.Block(c, c, **gn), t.Block(c, c, **gn), torch.nn.Upsample(scale_factor=2),
        t.conv(c, c, bias=False),
        t.Block(c, c), t.Block(c, c), t.Block(c, c), torch.nn.Upsample(scale_factor=2), t.conv(c, c, bias=False),
        t.Block(c, c), t.Block(c, c), t.Block(c, c), torch.nn.Upsample(scale_factor=2), t.conv(c, c, bias=False),
        t.Block(c, c), t.conv(c, 3)).eval()
    espec = [(k, tuple(v.shape)) for k, v in enc.state_dict().items()]
    dspec = [(k, tuple(v.shape)) for k, v in dec.state_dict().items()]
    ew, dw = make_weights(espec, 31), make_weights(dspec, 32)
    _load(enc, ew, lambda k: k)
    _load(dec, dw, lambda k: k)
    x2 = rs.uniform(0, 1, (1, 3, 32, 32)).astype(np.float32)
    with torch.no_grad():
        lat2 = enc(torch.from_numpy(x2))
        B, C, H, W = lat2.shape
        zp = lat2.view(B, C, H // 2, 2, W // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(B, C * 4, H // 2, W // 2)
        dec2 = dec(lat2)
    out.update(f2_enc_spec=_spec_json(espec), f2_dec_spec=_spec_json(dspec), f2_enc_seed=np.array(31),
               f2_dec_seed=np.array(32), f2_x=x2, f2_lat=lat2.numpy(), f2_zp=zp.numpy(), f2_dec=dec2.numpy())
    np.savez_compressed(os.path.join(FIX, "vae_tae.npz"), **out)
    n_f2 = sum(int(np.prod(s)) for _, s in espec + dspec)
    print("tae: tiny", sum(int(np.prod(s)) for _, s in spec), "params; f2", n_f2)


def taef2_real(taesd_path, shared):
    import torch
    from PIL import Image

    t = _taesd_module(taesd_path)
    models = os.path.join(shared, "models")
    m = t.TAESD(os.path.join(models, "taef2_encoder.pth"), os.path.join(models, "taef2_decoder.pth")).eval()
    im = Image.open(os.path.join(shared, "images", "cat_1024.png")).convert("RGB").resize((512, 512), Image.LANCZOS)
    x = torch.from_numpy(np.asarray(im).astype(np.float32) / 255).permute(2, 0, 1)[None]
    with torch.no_grad():
        z = m.encoder(x)
        y = m.decoder(z)
    mse = float(((y.clamp(0, 1) - x) ** 2).mean())
    psnr = 10 * np.log10(1 / mse)
    np.savez_compressed(os.path.join(FIX, "vae_taef2_real.npz"), latent=z.numpy(),
                        crop=y[:, :, 192:320, 192:320].numpy(), psnr=np.array(psnr),
                        provenance=np.array(f"torch {torch.__version__}, taesd.py at {TAESD_COMMIT}, "
                                            "Pillow LANCZOS 1024->512, x/255 float32"))
    print(f"taef2 real: psnr {psnr:.4f} dB")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--taesd", required=True, help="path to madebyollin/taesd's taesd.py")
    ap.add_argument("--shared", default=os.path.join(os.path.dirname(ROOT), "shared"))
    a = ap.parse_args()
    import torch
    torch.manual_seed(0)
    kl_goldens()
    tae_goldens(a.taesd)
    if os.path.isdir(os.path.join(a.shared, "models")):
        taef2_real(a.taesd, a.shared)
    else:
        print(f"{a.shared}/models not found: vae_taef2_real.npz not written")


if __name__ == "__main__":
    main()
