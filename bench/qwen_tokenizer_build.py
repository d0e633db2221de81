"""What building the real Qwen tokenizer offline costs (model.qwen_tokenizer), three ways in one run:

    python bench/qwen_tokenizer_build.py

cold       the merges recovered from the 151,643 ranks (model.bpe_merges_from_ranks) and the
           `tokenizers` pipeline built, no cache anywhere;
disk       the built tokenizer JSON read back from a cache folder (a new process with PARAVT_CACHE set);
memory     the JSON held in this process (every call after the first).
Each is timed --repeats times (median) on the full call, a PreTrainedTokenizerFast returned each time;
the merge recovery alone is timed too. Ratios are cold / disk and cold / memory. Last line: one JSON object.
"""
import argparse
import statistics
import tempfile
import time

from common import print_json, set_threads, table  # bench/common.py (puts the repo on sys.path)

import model as model_lib


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    set_threads(1)
    data, name = model_lib._qwen_ranks_file()
    ranks = model_lib.parse_bpe_ranks(data, name)
    merges_s = statistics.median(timed(lambda: model_lib.bpe_merges_from_ranks(ranks)) for _ in range(args.repeats))
    times = {"cold": [], "disk": [], "memory": []}
    with tempfile.TemporaryDirectory() as cache:
        for _ in range(args.repeats):
            model_lib._QWEN_TOKENIZER_JSON.clear()
            times["cold"].append(timed(lambda: model_lib.qwen_tokenizer(cache_dir=None)))
            model_lib._QWEN_TOKENIZER_JSON.clear()
            model_lib.qwen_tokenizer(cache_dir=cache)                     # writes the JSON once
            model_lib._QWEN_TOKENIZER_JSON.clear()
            times["disk"].append(timed(lambda: model_lib.qwen_tokenizer(cache_dir=cache)))
            times["memory"].append(timed(lambda: model_lib.qwen_tokenizer(cache_dir=None)))
    med = {k: statistics.median(v) for k, v in times.items()}
    print(table([[k, v] for k, v in [("merges from ranks", merges_s), *med.items()]], ["step", "seconds"]))
    print_json(dict(merges_s=merges_s, cold_s=med["cold"], disk_s=med["disk"], memory_s=med["memory"],
                    cold_over_disk=med["cold"] / med["disk"], cold_over_memory=med["cold"] / med["memory"]))


if __name__ == "__main__":
    main()
