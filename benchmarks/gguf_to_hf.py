"""Write the packaged SmolLM2 GGUF as a Hugging Face folder (bf16 safetensors, tokenizer, chat
template) for engines that do not read GGUF on this machine (vLLM's CPU build): this machine
reaches no model hub. Dequantized from Q4_1 by transformers, so the same weights llmd serves.
Run with the Python that has torch, transformers and accelerate (benchmarks/vllm_cpu.sh's).

    python benchmarks/gguf_to_hf.py GGUF OUT_DIR
"""

from __future__ import annotations

import sys
from pathlib import Path


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf, out = Path(sys.argv[1]), Path(sys.argv[2])
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype="bfloat16")
    # transformers marks a model read from GGUF as quantized and refuses to save it; its weights are
    # plain bf16 tensors by now, so save them as such
    model.hf_quantizer = None
    model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tok.save_pretrained(out)
    print(out)


if __name__ == "__main__":
    main()
