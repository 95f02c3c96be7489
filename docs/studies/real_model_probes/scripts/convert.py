"""Convert a GGUF model to a plain transformers folder once (each GGUF load dequantises for ~20 s).

usage: python convert.py GGUF_DIR GGUF_FILE OUT_DIR
"""
import sys
import time

from agentevo.models.backend import load_pretrained

t0 = time.time()
model, tokenizer = load_pretrained(sys.argv[1], sys.argv[2])
model.save_pretrained(sys.argv[3])
tokenizer.save_pretrained(sys.argv[3])
print(f"{sys.argv[3]}: {sum(p.numel() for p in model.parameters()):,} parameters, {time.time() - t0:.0f} s")
