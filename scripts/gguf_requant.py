"""Rewrite a GGUF file's 2-D weights as Q8_0, keeping everything else.

    python scripts/gguf_requant.py IN.gguf OUT.gguf

Every Q4_0 / Q4_1 / F16 / BF16 / F32 matrix (2-D tensor) is dequantized to float32 and
quantized again as Q8_0 (blocks of 32 along a row, one float16 scale each); Q8_0 matrices and 1-D
tensors (norms, biases) are copied as they are, so norms stay F32. From a Q4 file the result holds
the Q4 weights at 8 bits (not the original model's Q8_0): the same numbers within Q8_0's rounding. Every metadata field (hyper-parameters,
tokenizer, chat template) is copied with its value type; `general.file_type` becomes 7 (Q8_0),
so llama.cpp and transformers read the new file like one written by llama.cpp's own tools.
A row whose length is not a multiple of 32 cannot be Q8_0, and the tensor is copied unchanged.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType as QT
from gguf import GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.quants import dequantize, quantize

REQUANT = {QT.Q4_0, QT.Q4_1, QT.F16, QT.BF16, QT.F32}
Q8_BLOCK = 32
# Written by GGUFWriter itself (the header, the architecture, the alignment it uses).
SKIP = {"GGUF.version", "GGUF.tensor_count", "GGUF.kv_count", "general.architecture", "general.alignment"}


def field_value(field):
    """(value, type, sub_type) of one metadata field, as GGUFWriter.add_key_value takes them."""
    vtype = field.types[0]
    if vtype == GGUFValueType.ARRAY:
        if len(field.types) > 2:
            raise ValueError(f"{field.name}: nested arrays are not supported")
        return list(field.contents()), vtype, field.types[-1]
    return field.contents(), vtype, None


def requant(src: Path, dst: Path) -> dict[str, int]:
    reader = GGUFReader(src)
    arch = reader.fields["general.architecture"].contents()
    writer = GGUFWriter(dst, arch)
    if reader.alignment != writer.data_alignment:
        writer.data_alignment = reader.alignment
        writer.add_key_value("general.alignment", reader.alignment, GGUFValueType.UINT32)
    for name, field in reader.fields.items():
        if name in SKIP:
            continue
        value, vtype, sub_type = field_value(field)
        if name == "general.file_type":
            value = int(LlamaFileType.MOSTLY_Q8_0)
        writer.add_key_value(name, value, vtype, sub_type)
    counts: dict[str, int] = {}
    for t in reader.tensors:
        # t.shape is GGUF's order (ne0 = row length first); t.data is numpy's (rows, row bytes or row length).
        row_len = int(t.shape[0])
        if len(t.shape) == 2 and t.tensor_type in REQUANT and row_len % Q8_BLOCK == 0:
            w = dequantize(np.asarray(t.data), t.tensor_type).astype(np.float32, copy=False)
            # w: [rows, row_len] float32
            writer.add_tensor(t.name, quantize(w, QT.Q8_0), raw_dtype=QT.Q8_0)
            key = f"{t.tensor_type.name}->Q8_0"
        else:
            data = np.asarray(t.data)
            raw = None if t.tensor_type in (QT.F32, QT.F16) else t.tensor_type
            writer.add_tensor(t.name, data, raw_dtype=raw)
            key = f"{t.tensor_type.name} kept"
        counts[key] = counts.get(key, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return counts


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("src", type=Path)
    p.add_argument("dst", type=Path)
    args = p.parse_args(argv)
    if args.src.resolve() == args.dst.resolve():
        p.error("OUT must differ from IN")
    args.dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = args.dst.with_name(args.dst.name + ".part")
    counts = requant(args.src, tmp)
    tmp.replace(args.dst)
    print(f"{args.dst}: " + ", ".join(f"{n} {k}" for k, n in sorted(counts.items())))
    return 0


if __name__ == "__main__":
    sys.exit(main())
