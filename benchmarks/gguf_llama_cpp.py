"""llama.cpp's own forward on GGUF files mt writes: the logits of llama-cpp-python against
mt's, for a GPT-2 and a Llama (grouped-query attention) model, at each ``--gguf-type``.

llama-cpp-python is not a test dependency: it compiles llama.cpp from source (about 8 min on
these 2 cores), so it lives in its own virtual environment, named by ``--llama-python``:

    python3.11 -m venv /tmp/llvenv
    CMAKE_ARGS="-DGGML_NATIVE=OFF" /tmp/llvenv/bin/pip install llama-cpp-python==0.3.36
    python benchmarks/gguf_llama_cpp.py --llama-python /tmp/llvenv/bin/python

This script (mt's interpreter) writes the models and mt's logits; the llama.cpp side runs in
the other interpreter with an f32 KV cache (llama.cpp's default f16 cache alone moves logits
by ~1e-3) and one thread. Printed per model and type: the largest |logit difference| from mt's
model (what the type costs) and whether every position's argmax agrees, and from mt run on
the weights as the file stores them (what llama.cpp's arithmetic differs by).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch

from mt_formats import load_model, save_model
from mt_model import GPT, GPTConfig, preset

_LLAMA_SIDE = """
import json, sys
import numpy as np
from llama_cpp import Llama
job = json.loads(sys.argv[1])
llm = Llama(model_path=job["path"], logits_all=True, n_ctx=job["n_ctx"], verbose=False,
            n_threads=1, type_k=0, type_v=0)  # 0 = GGML_TYPE_F32
llm.eval(job["tokens"])
np.save(job["out"], np.array(llm.scores[:len(job["tokens"])], dtype=np.float32))
"""

MODELS = {
    "gpt2": preset("tiny").replace(gelu_approximate="tanh", seq_len=64),
    "llama": GPTConfig(n_layers=2, hidden=64, n_heads=4, n_kv_heads=2, vocab_size=1000,
                       seq_len=64, position="rope", norm="rmsnorm", mlp="swiglu", bias=False,
                       tied_embeddings=False, layernorm_eps=1e-5),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-python", required=True,
                        help="a Python with llama-cpp-python installed")
    parser.add_argument("--types", default="f32,f16,bf16,q8_0")
    args = parser.parse_args()
    tokens = torch.randint(0, 1000, (1, 24), generator=torch.Generator().manual_seed(5))
    with tempfile.TemporaryDirectory() as work:
        for name, config in MODELS.items():
            model = GPT(config, seed=2).eval()
            with torch.no_grad():
                ours = model(tokens)[0].numpy()
            for kind in args.types.split(","):
                folder = Path(work) / f"{name}-{kind}"
                save_model(model, folder, to="gguf", gguf_type=kind, tokenizer="tokenizer-1k")
                job = {"path": str(folder / "model.gguf"), "n_ctx": config.seq_len,
                       "tokens": tokens[0].tolist(), "out": str(folder / "logits.npy")}
                subprocess.run([args.llama_python, "-c", _LLAMA_SIDE, json.dumps(job)],
                               check=True, stderr=subprocess.DEVNULL)
                theirs = np.load(folder / "logits.npy")
                with torch.no_grad():  # mt on the weights as the file stores them
                    stored = load_model(folder).float().eval()(tokens)[0].numpy()
                agree = bool((theirs.argmax(-1) == ours.argmax(-1)).all())
                print(f"{name:6s} {kind:5s} vs mt's model: max|diff| "
                      f"{np.abs(theirs - ours).max():.2e}, argmax agrees: {agree:1}; vs mt on "
                      f"the file's weights: {np.abs(theirs - stored).max():.2e} "
                      f"(max|logit| {np.abs(ours).max():.2f})")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
