"""The Python reference of `recipes bench data`: the Hugging Face `tokenizers` package encoding the
same documents with the same tokenizer file on the same number of threads.

Reads a JSON list of text files on stdin (one document per file, UTF-8), loads them, then times
`encode_batch` over all of them once and prints {"secs": ..., "bytes": ..., "tokens": ...,
"ids_sha256": ...} (sha256 over every id as 4 little-endian bytes, documents in order).
Threads: RAYON_NUM_THREADS and RAYON_RS_NUM_THREADS (set by the caller).
"""

import hashlib
import json
import struct
import sys
import time

import tokenizers


def ids_sha256(encoded) -> str:
    h = hashlib.sha256()
    for e in encoded:
        h.update(struct.pack(f"<{len(e.ids)}I", *e.ids))
    return h.hexdigest()


def main() -> None:
    tokenizer = tokenizers.Tokenizer.from_file(sys.argv[1])
    paths = json.load(sys.stdin)
    texts = [open(p, encoding="utf-8").read() for p in paths]
    start = time.perf_counter()
    encoded = tokenizer.encode_batch(texts, add_special_tokens=False)
    secs = time.perf_counter() - start
    print(json.dumps({
        "secs": secs,
        "bytes": sum(len(t.encode("utf-8")) for t in texts),
        "tokens": sum(len(e.ids) for e in encoded),
        "ids_sha256": ids_sha256(encoded),
        "version": tokenizers.__version__,
    }))


if __name__ == "__main__":
    main()
