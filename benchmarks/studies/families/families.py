"""Families x methods: every decoding method on every Hugging Face target family, on tiny random
folders built with transformers' own classes (vvs_engine.models.hf_tiny).

For each family and method: greedy CFG tokens vs plain AR (fp64, a random drafter), and one sampled
run (temperature 1, CFG 3, seed 0) with its tokens per forward (TPF) and whether the family's layout
held. Per family: the native image decoder's largest pixel difference from transformers' on the
greedy images, and the images ``generate`` returns. TPF on random weights with an untrained drafter says nothing about real speed-ups; the table
shows that each method runs on each family and which ones are lossless there.

    python benchmarks/studies/families/families.py --threads 1   # writes benchmarks/studies/families/families.md and the table in docs/families.md
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile

import torch

HERE = os.path.dirname(os.path.abspath(__file__))  # benchmarks/studies/<study>: its tables live here
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(HERE)))
COMMAND = "python benchmarks/studies/families/families.py --threads 1"
METHODS = [("ar", {}), ("eagle", {}), ("lantern", {"lantern_delta": 0.0}), ("lantern++", {}),
           ("vvs", {"skip_interval": 1}), ("vvs", {}), ("sjd", {}), ("gsd", {}), ("cascade", {})]
LOSSLESS = {("eagle", ()), ("lantern", (("lantern_delta", 0.0),)), ("vvs", (("skip_interval", 1),)),
            ("sjd", ()), ("gsd", ())}
PROMPTS = ["a red cat", "a photo of the small blue dog on the grass"]


def family_engines(tmp: str):
    """-> [(name, fp64 engine with a random drafter, fp32 engine, transformers model, folder)]."""
    from vvs_engine.drafting.drafter import Drafter, DrafterConfig
    from vvs_engine.engine import Engine
    from vvs_engine.models.hf_tiny import make_chameleon_folder, make_emu3_folder, make_janus_folder

    out = []
    for name, make, kw in (("Janus-Pro (janus)", make_janus_folder, dict(max_prompt_tokens=24)),
                           ("Lumina-mGPT (chameleon)", make_chameleon_folder,
                            dict(max_prompt_tokens=32, image_size=64)),
                           ("Emu3 (emu3)", make_emu3_folder, dict(max_prompt_tokens=24, image_size=32))):
        path = os.path.join(tmp, name.split()[0])
        hf = make(path)
        fp32 = Engine.load(model_dir=path, **kw)
        eng = Engine.load(model_dir=path, **kw)
        c = eng.config
        torch.manual_seed(0)  # the random drafter does not depend on what was built before it
        eng.drafter = Drafter(DrafterConfig(dim=c.dim, n_head=c.n_head)).attach(eng.gpt).eval()
        eng.gpt.to(torch.float64)
        eng.drafter.to(torch.float64)
        eng.dtype = torch.float64
        out.append((name, eng, fp32, hf, path))
    return out


DECODER = {"janus": ("taming VQ-16 (`model.vqmodel.*`)", "`JanusModel.decode_image_tokens`"),
           "chameleon": ("taming VQGAN (`vq_config`; decoder from `vqgan.ckpt`/`vqgan.safetensors` or "
                         "`model.vqmodel.decoder.*`)",
                         "`ChameleonVQVAE` codebook + `post_quant_conv`, `JanusVQVAEDecoder` with the VQGAN weights"),
           "emu3": ("MoVQ (`model.vqmodel.*` / `vqmodel.*`)", "`Emu3VQVAE.decode`")}


def reference_decode(family: str, hf, path: str, eng, tokens):
    """transformers' pixels for method tokens (the oracle of tests/test_families.py)."""
    c = eng.config
    if family == "janus":
        return hf.decode_image_tokens(tokens).permute(0, 3, 1, 2)
    codes = eng.gpt.codes_of(tokens).view(tokens.shape[0], c.grid_h, c.grid_w)
    if family == "emu3":
        return hf.model.vqmodel.decode(codes)
    from vvs_engine.models.hf_tiny import janus_decoder_like

    vqm = hf.model.vqmodel
    n = len(vqm.config.channel_multiplier)
    ref = janus_decoder_like(vqm.config)
    sd = torch.load(os.path.join(path, "vqgan.ckpt"), weights_only=True)["state_dict"]
    own = {}
    for k, v in sd.items():
        if k.startswith("decoder.up."):
            level, rest = k[len("decoder.up."):].split(".", 1)
            own[f"up.{n - 1 - int(level)}.{rest}"] = v
        elif k.startswith("decoder."):
            own[k[len("decoder."):]] = v
    ref.load_state_dict(own, strict=True)  # the tiny folder's VQGAN has attention at the lowest level
    return ref(vqm.post_quant_conv(vqm.quantize.embedding(codes).permute(0, 3, 1, 2)))


@torch.no_grad()
def decoder_row(name: str, eng, hf, path: str):
    family = name.split("(")[1].rstrip(")")
    out = eng.generate(prompts=PROMPTS, temperature=0, cfg_scale=3.0)
    diff = (eng.vq.decode(out.tokens) - reference_decode(family, hf, path, eng, out.tokens)).abs().max()
    w, h = out.images[0].size
    arch, oracle = DECODER[family]
    return (name, arch, oracle, f"{diff:.1e}", f"{len(out.images)} x {w}x{h}")


def layout_ok(eng, tokens) -> bool:
    c = eng.config
    if not hasattr(c, "grid_w") or not hasattr(eng.gpt, "codes_of"):
        return bool((tokens < c.vocab_size).all())
    rows = tokens.view(tokens.shape[0], c.grid_h, c.grid_w + 1)
    return bool((rows[:, :, -1] == c.n_codes).all() and (rows[:, :, :-1] < c.n_codes).all())


def label(method, opts):
    return method + ("(" + ",".join(f"{k}={v}" for k, v in opts.items()) + ")" if opts else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=os.path.join(HERE, "families.md"))
    ap.add_argument("--no-readme", action="store_true", help="do not rewrite the table in docs/families.md")
    a = ap.parse_args(argv)
    torch.set_num_threads(a.threads)
    rows, dec_rows = [], []
    with tempfile.TemporaryDirectory() as tmp:
        for fam, eng, fp32, hf, path in family_engines(tmp):
            dec_rows.append(decoder_row(fam, fp32, hf, path))
            print(" | ".join(dec_rows[-1]), flush=True)
            greedy = dict(prompts=PROMPTS, temperature=0, cfg_scale=3.0, decode_images=False)
            ar = eng.generate(**greedy).tokens
            for method, opts in METHODS:
                g = eng.generate(method=method, **greedy, **opts).tokens
                s = eng.generate(method=method, prompts=PROMPTS, temperature=1.0, cfg_scale=3.0, seed=0,
                                 decode_images=False, **opts)
                lossless = method == "ar" or (method, tuple(sorted(opts.items()))) in LOSSLESS
                same = "yes" if torch.equal(g, ar) else "no"
                rows.append((fam, label(method, opts), "lossless" if lossless else "relaxed", same,
                             f"{s.stats['tpf']:.2f}", "yes" if layout_ok(eng, s.tokens) else "NO"))
                print(" | ".join(rows[-1]), flush=True)
    head = ("| family | method | kind | greedy = AR | TPF (sampled, random drafter) | layout held |\n"
            "|---|---|---|---|---|---|\n")
    table = head + "".join("| " + " | ".join(r) + " |\n" for r in rows)
    dec_head = ("\n| family | image decoder (native) | transformers reference | max \\|Δ\\| pixels (fp32) | "
                "images from `generate` (greedy, CFG 3) |\n|---|---|---|---|---|\n")
    table += dec_head + "".join("| " + " | ".join(r) + " |\n" for r in dec_rows)
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        f.write(f"# Families x methods\n\nWritten by `{COMMAND}`.\n\n{table}")
    if not a.no_readme:
        readme = os.path.join(ROOT, "docs", "families.md")
        text = open(readme).read()
        block = f"<!-- families-table: written by `{COMMAND}` -->\n{table}<!-- /families-table -->"
        new = re.sub(r"<!-- families-table:.*?<!-- /families-table -->", lambda _: block, text, flags=re.S)
        if new == text and block not in text:
            print("docs/families.md has no families-table markers; table written to " + a.out, file=sys.stderr)
        with open(readme, "w") as f:
            f.write(new)
    print("wrote " + a.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
