"""TPE benchmarks: speed against Hugging Face ``tokenizers`` (``speed``) and compression (``sweep``).

``speed``: real step sequences (the bundled H200 recording, plus any ``--runs``) repeated with
random perturbations until the corpus holds ``--symbols`` symbols: per synthetic step, a random
real step with about 1% of its nodes relabelled (another symbol of the same layer), a few subtrees
dropped and a few small subtrees duplicated in place (the copy is the next sibling). Perturbations
keep a valid depth-first order; parents come from the depths. The same symbol streams go to both
trainers: TPE gets the trees; ``tokenizers`` gets each step as one word, one character per symbol
id (no pre-tokenizer, no normalizer), with the same number of new tokens to learn (``vocab_size``
= its alphabet + the number of tokens TPE created) and the same ``min_frequency``.
``RAYON_NUM_THREADS`` (``--threads``) is set before ``tokenizers`` loads; TPE is single-threaded.
Timings are wall seconds of the call only (corpus built and checked beforehand, as the serializer
does); each trainer runs ``--repeat`` times and the median is reported.

``sweep``: mean per-step length reduction (1 - tokens / nodes, averaged over steps) for a range of
vocabulary sizes, on the bundled recording and the ``--runs`` given as ``LABEL=PATH``: in-sample
(train and encode all steps) and held-out (train on the even-numbered steps of each run, encode
the odd ones). One training per corpus at the largest size; smaller sizes are its prefixes
(:meth:`TraceTokenizer.truncate`, exact for greedy merges). Writes a JSON file, a Markdown table
and, when matplotlib is installed, a PNG plot.

    python benchmarks/bench_tpe.py speed --symbols 10000000 --vocab-size 4096 --runs /tmp/cpu_b
    python benchmarks/bench_tpe.py sweep --runs "CPU A=/tmp/cpu_a" "CPU B=/tmp/cpu_b" --png docs/tpe_sweep.png
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
    from teller.tpe.serialize import serialize_run

    table: dict[str, int] = {}
    steps = []
    for run in runs:
        s = serialize_run(run)
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


def _example_run() -> Path:
    """The bundled recording, ingested and reconstructed into a temporary run directory."""
    from teller.ingest import ingest
    from teller.reconstruct import reconstruct

    out = Path(tempfile.mkdtemp(prefix="teller_bench_tpe_")) / "h200"
    ingest(REPO / "examples" / "h200_llama8l_cupti", out)
    reconstruct(out)
    return out


def speed(args: argparse.Namespace) -> int:
    os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "true")

    from tokenizers import Tokenizer, models, trainers

    from teller.tpe.serialize import Sequences, check_preorder, dfs_parents
    from teller.tpe.trainer import train

    symbols, steps = real_steps([_example_run(), *args.runs])
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


def sweep(args: argparse.Namespace) -> int:
    from teller.tpe.serialize import (
        Sequences,
        check_preorder,
        dfs_parents,
        serialize_run,
    )
    from teller.tpe.trainer import train

    runs = [("H200 example", _example_run())]
    for spec in args.runs:
        label, _, path = spec.rpartition("=")
        runs.append((label or Path(path).name, Path(path)))
    per_run = {label: serialize_run(path) for label, path in runs}
    corpora = [(label, [per_run[label]]) for label, _ in runs]
    if len(runs) > 1:
        corpora.append(("all together", list(per_run.values())))
    if args.synthetic:
        symbols, steps = real_steps([p for _, p in runs])
        codes, depth, dur, offsets = synthesize(symbols, steps, args.synthetic, args.seed)
        syn = Sequences(symbols, codes, dfs_parents(depth, offsets).astype(np.int32), depth, dur, offsets)
        check_preorder(syn.parent, syn.depth, syn.offsets)
        syn.checked = True
        corpora.append((f"synthetic {args.synthetic / 1e6:g}M", [syn]))
    rows = []
    for cap in args.caps:
        for name, batches in corpora:
            full = Sequences.concat(batches)
            even = Sequences.concat([b.select(np.arange(0, len(b), 2)) for b in batches])
            odd = Sequences.concat([b.select(np.arange(1, len(b), 2)) for b in batches])
            t0 = time.perf_counter()
            tok_in = train(full, max(args.sizes), min_frequency=args.min_frequency, max_token_nodes=cap or None)
            tok_ho = train(even, max(args.sizes), min_frequency=args.min_frequency, max_token_nodes=cap or None)
            secs = time.perf_counter() - t0
            print(f"{name}, cap {cap or '-'}: {len(full)} steps, {full.n_nodes:,} nodes; in-sample vocabulary stops at "
                  f"{len(tok_in)} ({tok_in.meta['training']['stop']}); held-out at {len(tok_ho)} ({secs:.1f} s)", file=sys.stderr)
            for v in sorted({tok_in.n_base, *(x for x in args.sizes if x > tok_in.n_base)}):
                ti, th = tok_in.truncate(v), tok_ho.truncate(v)
                ei, eh = ti.encode_batch(full), th.encode_batch(odd)
                rows.append({
                    "corpus": name,
                    "max_token_nodes": cap or None,
                    "steps": len(full),
                    "nodes": full.n_nodes,
                    "mean_step_nodes": float(full.lengths().mean()),
                    "vocab_requested": v,
                    "vocab_in_sample": len(ti),
                    "vocab_held_out": len(th),
                    "base_vocab": tok_in.n_base,
                    "in_sample_reduction": float(np.mean(1 - ei.lengths() / full.lengths())),
                    "in_sample_mean_tokens": float(ei.lengths().mean()),
                    "held_out_reduction": float(np.mean(1 - eh.lengths() / odd.lengths())),
                    "held_out_mean_tokens": float(eh.lengths().mean()),
                    "held_out_unknown": int(eh.n_unknown.sum()),
                })
    transfer = []
    for spec in args.transfer:
        src, _, dst = spec.partition("->")
        train_on, test_on = Sequences.concat([per_run[x] for x in src.split("+")]), per_run[dst]
        for cap in args.caps:
            tok = train(train_on, max(args.sizes), min_frequency=args.min_frequency, max_token_nodes=cap or None)
            for v in sorted({tok.n_base, *(x for x in args.sizes if x > tok.n_base)}):
                e = tok.truncate(v).encode_batch(test_on)
                transfer.append({"train": src, "test": dst, "max_token_nodes": cap or None, "vocab_requested": v,
                                 "vocab": len(tok.truncate(v)), "reduction": float(np.mean(1 - e.lengths() / test_on.lengths())),
                                 "unknown_share": float(e.n_unknown.sum() / test_on.n_nodes)})
    if args.out:
        args.out.write_text(json.dumps({"rows": rows, "transfer": transfer}, indent=1))
    names = [n for n, _ in corpora]
    for t in transfer:
        print(f"transfer {t['train']} -> {t['test']}, cap {t['max_token_nodes'] or '-'}, vocabulary {t['vocab']}: "
              f"{t['reduction']:.1%} (unknown nodes {t['unknown_share']:.1%})")
    for cap in args.caps:
        print(f"\nmax_token_nodes = {cap or 'none'} (in-sample / held-out; * = training stopped below the size asked)\n")
        print("| vocabulary | " + " | ".join(names) + " |")
        print("|---|" + "---|" * len(names))
        base = {n: next(r for r in rows if r["corpus"] == n) for n in names}
        print("| base vocabulary (nodes per step) | " + " | ".join(f"{base[n]['base_vocab']} ({base[n]['mean_step_nodes']:.0f})" for n in names) + " |")
        for v in sorted(set(args.sizes)):
            cells = []
            for n in names:
                r = next((r for r in rows if r["corpus"] == n and r["vocab_requested"] == v and r["max_token_nodes"] == (cap or None)), None)
                if r is None and v <= base[n]["base_vocab"]:
                    cells.append("(below base)")
                    continue
                cells.append("" if r is None else f"{r['in_sample_reduction']:.1%} / {r['held_out_reduction']:.1%}" + ("*" if r["vocab_in_sample"] < v else ""))
            print(f"| {v} | " + " | ".join(cells) + " |")
    if args.png:
        try:
            import matplotlib

            matplotlib.use("Agg")
            import matplotlib.pyplot as plt
        except ImportError:
            print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
            return 0
        fig, axes = plt.subplots(1, len(args.caps), figsize=(6.2 * len(args.caps), 4.4), squeeze=False, sharey=True)
        for ax, cap in zip(axes[0], args.caps, strict=True):
            for k, n in enumerate(names):
                rs = [r for r in rows if r["corpus"] == n and r["max_token_nodes"] == (cap or None)]
                x = [min(r["vocab_requested"], r["vocab_in_sample"]) for r in rs]
                ax.plot(x, [100 * r["in_sample_reduction"] for r in rs], "-o", ms=3, color=f"C{k}", label=f"{n}")
                ax.plot(x, [100 * r["held_out_reduction"] for r in rs], "--", color=f"C{k}")
            ax.axhline(80, color="grey", lw=0.8, ls=":")
            ax.set_xscale("log")
            ax.set_xlabel("vocabulary size")
            ax.set_title(f"max_token_nodes = {cap or 'none'}  (solid: in-sample, dashed: held-out)", fontsize=9)
            ax.grid(alpha=0.3)
        axes[0][0].set_ylabel("mean per-step length reduction (%)")
        axes[0][0].legend(fontsize=8)
        fig.tight_layout()
        fig.savefig(args.png, dpi=130)
        print(f"plot: {args.png}", file=sys.stderr)
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    sp = sub.add_parser("speed", help="training and encoding speed vs tokenizers")
    sp.add_argument("--symbols", type=int, default=10_000_000)
    sp.add_argument("--vocab-size", type=int, default=4096)
    sp.add_argument("--min-frequency", type=int, default=2)
    sp.add_argument("--runs", type=Path, nargs="*", default=[], help="Extra reconstructed runs to draw steps from.")
    sp.add_argument("--threads", type=int, default=1, help="RAYON_NUM_THREADS for tokenizers.")
    sp.add_argument("--repeat", type=int, default=1)
    sp.add_argument("--seed", type=int, default=0)
    sp.add_argument("--out", type=Path, default=None, help="Write the figures as JSON here.")
    sw = sub.add_parser("sweep", help="compression for a range of vocabulary sizes")
    sw.add_argument("--runs", nargs="*", default=[], help="LABEL=PATH of reconstructed runs besides the bundled one.")
    sw.add_argument("--sizes", type=int, nargs="+", default=[128, 160, 192, 256, 320, 384, 512, 768, 1024, 2048, 4096])
    sw.add_argument("--min-frequency", type=int, default=2)
    sw.add_argument("--caps", type=int, nargs="+", default=[0, 16], help="max_token_nodes values (0: no limit).")
    sw.add_argument("--synthetic", type=int, default=1_000_000, help="Also a perturbed synthetic corpus of this many symbols (0: none).")
    sw.add_argument("--seed", type=int, default=0)
    sw.add_argument("--transfer", nargs="*", default=[], help='"TRAIN+TRAIN->TEST" run labels: train on some runs, encode another.')
    sw.add_argument("--out", type=Path, default=None, help="Write the rows as JSON here.")
    sw.add_argument("--png", type=Path, default=None, help="Write the plot here.")
    args = ap.parse_args()
    return speed(args) if args.cmd == "speed" else sweep(args)


if __name__ == "__main__":
    sys.exit(main())
