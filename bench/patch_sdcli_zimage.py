"""Patch the 0.4.7 sdist's stable-diffusion.cpp (an extracted copy, never this repo) so its Z-Image
DiT reads its shape from the weights, for reduced random checkpoints (tests/test_zimage_sdcli.py).

    python3 bench/patch_sdcli_zimage.py SD_CPP_DIR/src/z_image.hpp

The sdist fixes ZImageParams at the released model (30 main + 2 refiner layers, hidden 3840, 30
heads of 128, caption features 2560); a smaller file fails to load. Upstream later counts the
layers from the weights; this patch does that and also takes the width from x_embedder, the
caption width from cap_embedder.0 and the head count as width / 128 (head_dim and the RoPE axes
stay as in the sdist). With a released Z-Image file every value equals the default: nothing changes.
Idempotent (marker: "sdrt-patch: Z-Image shape from weights").
"""
import sys

path = sys.argv[1]
s = open(path, newline="").read()
MARK = "sdrt-patch: Z-Image shape from weights"
if MARK in s:
    print("already patched", path)
    sys.exit(0)
eol = "\r\n" if "\r\n" in s else "\n"
anchor = """            : GGMLRunner(backend, offload_params_to_cpu) {
            z_image = ZImageModel(z_image_params);"""
assert s.count(anchor.replace("\n", eol)) == 1, "z_image.hpp: ZImageRunner constructor not where the 0.4.7 sdist has it"
patched = """            : GGMLRunner(backend, offload_params_to_cpu) {
            // sdrt-patch: Z-Image shape from weights (layer counts as upstream; width, heads and
            // caption width from x_embedder / cap_embedder), so reduced checkpoints load.
            {
                auto count = [&](const std::string& stem) {
                    std::string p = prefix + "." + stem;
                    int64_t n     = 0;
                    for (const auto& [name, _] : tensor_storage_map) {
                        if (name.rfind(p, 0) != 0) {
                            continue;
                        }
                        size_t dot = name.find('.', p.size());
                        if (dot != std::string::npos) {
                            n = std::max<int64_t>(n, atoi(name.substr(p.size(), dot - p.size()).c_str()) + 1);
                        }
                    }
                    return n;
                };
                int64_t layers = count("layers."), refiners = count("noise_refiner.");
                if (layers > 0) {
                    z_image_params.num_layers = layers;
                }
                if (refiners > 0) {
                    z_image_params.num_refiner_layers = refiners;
                }
                for (const auto& [name, ts] : tensor_storage_map) {
                    if (name == prefix + ".x_embedder.weight") {
                        z_image_params.hidden_size  = ts.ne[1];
                        z_image_params.num_heads    = z_image_params.hidden_size / z_image_params.head_dim;
                        z_image_params.num_kv_heads = z_image_params.num_heads;
                    } else if (name == prefix + ".cap_embedder.0.weight") {
                        z_image_params.cap_feat_dim = ts.ne[0];
                    }
                }
            }
            z_image = ZImageModel(z_image_params);"""
s = s.replace(anchor.replace("\n", eol), patched.replace("\n", eol))
open(path, "w", newline="").write(s)
print("patched", path)
