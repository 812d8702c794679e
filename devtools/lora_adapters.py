"""Adapter-only saves of a LoRA fine-tune, then the PEFT export (docs/INTEROP.md, "LoRA adapters").

``python -m devtools.lora_adapters [DIR]`` saves a random Llama-shaped base in the
``hf_llama_from_nnx`` layout with ``nnx.LoRALinear``-style pairs on q/v (rank 8) through
``bridges.torch.save``, then a second step in which only the adapters changed, and prints the
bytes each step wrote and referenced (the manifest's own figures, as ``ckptfmt ls`` shows
them), then times ``export_peft`` of the second step. Figures depend on the disk.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import time

import numpy as np

__all__ = ["main"]

CONFIG = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
              num_key_value_heads=8, head_dim=64, rms_norm_eps=1e-6, tie_word_embeddings=False)
RANK = 8


def _state(rng: np.random.Generator, adapters_seed: int) -> dict:
    import torch

    c = CONFIG
    d, h, hd, L, f, v = (c["hidden_size"], c["num_attention_heads"], c["head_dim"], c["num_hidden_layers"],
                         c["intermediate_size"], c["vocab_size"])
    r = lambda g, *s: torch.from_numpy((g.standard_normal(s) * 0.02).astype(np.float32))  # noqa: E731
    g = np.random.default_rng(0)  # the frozen base: the same bytes every step
    layers = {"attn": {n: {"kernel": r(g, L, d, h, hd)} for n in "qkv"}, "mlp": {}}
    layers["attn"]["o"] = {"kernel": r(g, L, h, hd, d)}
    layers["mlp"] = {"gate": {"kernel": r(g, L, d, f)}, "up": {"kernel": r(g, L, d, f)}, "down": {"kernel": r(g, L, f, d)}}
    layers["attn_norm"], layers["mlp_norm"] = {"scale": r(g, L, d) + 1}, {"scale": r(g, L, d) + 1}
    a = np.random.default_rng(adapters_seed)
    for n in "qv":
        layers["attn"][n]["lora"] = {"lora_a": r(a, L, d, RANK), "lora_b": r(a, L, RANK, h, hd)}
    return {"model": {"embed": {"embedding": r(g, v, d)}, "layers": layers, "norm": {"scale": r(g, d) + 1},
                      "lm_head": {"kernel": r(g, d, v)}}}


def main(argv: list[str] | None = None) -> None:
    from bridges import torch as bt
    from bridges.interop import export_peft

    root = (argv or sys.argv[1:] or [tempfile.mkdtemp(prefix="ckptfmt-lora-")])[0]
    url = f"{root}/repo"
    for step in (1, 2):
        t0 = time.perf_counter()
        bt.save(url, _state(np.random.default_rng(step), adapters_seed=step), step=step)
        print(f"save step {step}: {time.perf_counter() - t0:.3f} s")
    out = subprocess.run([sys.executable, "-m", "ckptfmt", "ls", "--json", url], capture_output=True, text=True)
    print(out.stdout if out.returncode == 0 else out.stderr)
    rep = export_peft(url, f"{root}/adapter", config=CONFIG)
    print(json.dumps({"export_peft": {"files": rep.files, "nbytes": rep.nbytes, "bytes_read": rep.bytes_read,
                                      "seconds": round(rep.seconds, 3)}}))


if __name__ == "__main__":
    main()
