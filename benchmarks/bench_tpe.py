"""TPE training and encoding speed, side by side with the Hugging Face ``tokenizers`` BPE trainer.

Corpus: real step sequences (the bundled H200 recording, plus any ``--runs``) repeated with
random perturbations until it holds ``--symbols`` symbols: per synthetic step, a random real step
with about 1% of its nodes relabelled (another symbol of the same layer), a few subtrees dropped
and a few subtrees duplicated in place (the copy is the next sibling). Perturbations keep a valid
depth-first order; parents come from the depths.

The same symbol streams go to both trainers: TPE gets the trees; ``tokenizers`` gets each step as
one word, one character per symbol id (no pre-tokenizer, no normalizer), with the same number of
new tokens to learn (``vocab_size`` = its alphabet + the number of tokens TPE created) and the
same ``min_frequency``. ``RAYON_NUM_THREADS`` (``--threads``) is set before ``tokenizers`` loads;
TPE is single-threaded. Timings are wall seconds of the call only (corpus built beforehand);
each trainer runs ``--repeat`` times and the median is reported.

    python benchmarks/bench_tpe.py --symbols 10000000 --vocab-size 4096 --runs /tmp/cpurun
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

REPO = Path(__file__).resolve().parents[1]


def _peak_rss_mib() -> float:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return float("nan")


def real_steps(runs: list[Path]):
    """Serialized steps of the runs, one global symbol table."""
    from teller.tpe.serialize import load_forest, serialize_steps

    table: dict[str, int] = {}
    steps = []
    for run in runs:
        f = load_forest(run)
        s = serialize_steps(f)
        lut = np.array([table.setdefault(x, len(table)) for x in s.symbols], dtype=np.int32)
        for i in range(len(s)):
            a, b = s.offsets[i], s.offsets[i + 1]
            steps.append((lut[s.codes[a:b]], s.depth[a:b].astype(np.int32), s.duration[a:b]))
    return list(table), steps


def subtree_ends(depth: np.ndarray) -> np.ndarray:
    """End (exclusive) of every node's subtree in a preorder given by depths."""
    n = len(depth)
    end = np.full(n, n, dtype=np.int64)
    for d in range(int(depth.max(initial=0)) + 1):
        at = np.flatnonzero(depth == d)
        upto = np.flatnonzero(depth <= d)
        j = np.searchsorted(upto, at, side="right")
        ok = j < len(upto)
        end[at[ok]] = upto[j[ok]]
    return end


def synthesize(symbols: list[str], steps, n_symbols: int, seed: int = 0, relabel: float = 0.01, drops: float = 2.0, dups: float = 2.0):
    """Perturbed copies of real steps until ``n_symbols`` symbols (codes, depth, duration, offsets)."""
    rng = np.random.default_rng(seed)
    layer = np.array([s.split(" ", 1)[0] for s in symbols])
    same_layer = {lay: np.flatnonzero(layer == lay) for lay in set(layer.tolist())}
    out_c, out_d, out_t, lens = [], [], [], []
    total = 0
    while total < n_symbols:
        c, d, t = steps[rng.integers(len(steps))]
        c, d, t = c.copy(), d.copy(), t.copy()
        # relabel ~1% of nodes (not the root) within their layer
        k = rng.binomial(len(c) - 1, relabel) if len(c) > 1 else 0
        if k:
            idx = rng.choice(np.arange(1, len(c)), size=k, replace=False)
            for i in idx.tolist():
                pool = same_layer[layer[c[i]]]
                c[i] = pool[rng.integers(len(pool))]
        for _ in range(rng.poisson(drops)):
            if len(c) < 3:
                break
            i = int(rng.integers(1, len(c)))
            e = subtree_ends(d)[i]
            keep = np.r_[0:i, e:len(c)]
            c, d, t = c[keep], d[keep], t[keep]
        for _ in range(rng.poisson(dups)):
            if len(c) < 2:
                break
            i = int(rng.integers(1, len(c)))
            e = subtree_ends(d)[i]
            if e - i > 64:  # keep copies small (an extra op or kernel, not a whole layer)
                continue
            ins = np.r_[0:e, i:e, e:len(c)]
            c, d, t = c[ins], d[ins], t[ins]
        out_c.append(c)
        out_d.append(d)
        out_t.append(t)
        lens.append(len(c))
        total += len(c)
    offsets = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=offsets[1:])
    return np.concatenate(out_c), np.concatenate(out_d), np.concatenate(out_t), offsets


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--symbols", type=int, default=10_000_000)
    ap.add_argument("--vocab-size", type=int, default=4096)
    ap.add_argument("--min-frequency", type=int, default=2)
    ap.add_argument("--runs", type=Path, nargs="*", default=[], help="Extra reconstructed runs to draw steps from.")
    ap.add_argument("--threads", type=int, default=1, help="RAYON_NUM_THREADS for tokenizers.")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="Write the figures as JSON here.")
    args = ap.parse_args()
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

    from tokenizers import Tokenizer, models, trainers

    from teller.ingest import ingest
    from teller.reconstruct import reconstruct
    from teller.tpe.serialize import Sequences, check_preorder, dfs_parents
    from teller.tpe.trainer import train

    tmp = Path(tempfile.mkdtemp(prefix="teller_bench_tpe_"))
    example = tmp / "h200"
    ingest(REPO / "examples" / "h200_llama8l_cupti", example)
    reconstruct(example)
    symbols, steps = real_steps([example, *args.runs])
    t0 = time.perf_counter()
    codes, depth, dur, offsets = synthesize(symbols, steps, args.symbols, args.seed)
    parent = dfs_parents(depth, offsets).astype(np.int32)
    corpus = Sequences(symbols, codes, parent, depth, dur, offsets)
    check_preorder(corpus.parent, corpus.depth, corpus.offsets)  # as the serializer does; not timed
    corpus.checked = True
    print(f"corpus: {len(steps)} real steps → {len(corpus)} synthetic steps, {corpus.n_nodes:,} symbols, "
          f"{len(symbols)} distinct ({time.perf_counter() - t0:.1f} s to build)", file=sys.stderr)

    # ---- TPE ------------------------------------------------------------------------------------
    tpe_train = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        tok = train(corpus, args.vocab_size, min_frequency=args.min_frequency)
        tpe_train.append(time.perf_counter() - t)
    tinfo = tok.meta["training"]
    new_tokens = len(tok) - tok.n_base
    tpe_enc = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        enc = tok.encode_batch(corpus)
        tpe_enc.append(time.perf_counter() - t)
    tpe_red = float(np.mean(1 - enc.lengths() / corpus.lengths()))
    rss_tpe = _peak_rss_mib()

    # ---- tokenizers -----------------------------------------------------------------------------
    base = 0x4E00  # CJK block: one printable character per symbol id
    chars = (codes.astype(np.uint32) + base)
    words = [chars[offsets[i]:offsets[i + 1]].tobytes().decode("utf-32-le") for i in range(len(corpus))]
    alphabet = [chr(base + i) for i in range(len(symbols))]
    hf_train = []
    for _ in range(args.repeat):
        hf = Tokenizer(models.BPE())
        trainer = trainers.BpeTrainer(vocab_size=len(alphabet) + new_tokens, min_frequency=args.min_frequency,
                                      show_progress=False, initial_alphabet=alphabet, special_tokens=[])
        t = time.perf_counter()
        hf.train_from_iterator(words, trainer)
        hf_train.append(time.perf_counter() - t)
    hf_enc = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        out = hf.encode_batch(words, add_special_tokens=False)
        hf_enc.append(time.perf_counter() - t)
    hf_lens = np.array([len(e.ids) for e in out])
    hf_red = float(np.mean(1 - hf_lens / corpus.lengths()))

    import tokenizers

    n = corpus.n_nodes
    res = {
        "symbols": n,
        "steps": len(corpus),
        "distinct_symbols": len(symbols),
        "vocab_size": len(tok),
        "new_tokens": new_tokens,
        "tpe_merges": tinfo["merges"],
        "tpe_stop": tinfo["stop"],
        "hf_vocab_size": hf.get_vocab_size(),
        "tpe_train_s": statistics.median(tpe_train),
        "hf_train_s": statistics.median(hf_train),
        "train_ratio_tpe_over_hf": statistics.median(tpe_train) / statistics.median(hf_train),
        "tpe_encode_s": statistics.median(tpe_enc),
        "hf_encode_s": statistics.median(hf_enc),
        "tpe_encode_symbols_per_s": n / statistics.median(tpe_enc),
        "hf_encode_symbols_per_s": n / statistics.median(hf_enc),
        "tpe_tokens_out": int(enc.lengths().sum()),
        "hf_tokens_out": int(hf_lens.sum()),
        "tpe_mean_step_reduction": tpe_red,
        "hf_mean_step_reduction": hf_red,
        "tpe_peak_rss_mib": rss_tpe,
        "peak_rss_mib": _peak_rss_mib(),
        "rayon_threads": args.threads,
        "tokenizers_version": tokenizers.__version__,
        "numpy_version": np.__version__,
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
    }
    print(json.dumps(res, indent=2))
    if args.out:
        args.out.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
