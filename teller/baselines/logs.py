"""Log-based baselines of docs/design.md §11, compact torch models in the manner of four papers.

Every method reads the service-log lines aligned to a step (``logs.parquet`` of the dataset,
the lines of the step's units, in time order: :func:`step_logs`), not its trace. The templates
are the dataset's own (``template`` column: drain3 over the whole log with the masks of
:mod:`teller.logs.templates`, no labels involved). None of these methods has a fault-type or an
operator head (a log line names no operator), so ``fault_type`` and ``operators`` are None.
Every model runs on the CPU with one thread, seeded (``seed``), a bounded number of updates.

- **LogRobust** (Zhang et al., FSE 2019; ``logrobust``): a step is the sequence of its lines'
  template semantic vectors; an attention Bi-LSTM classifies it (supervised, class-weighted
  cross entropy). Semantic vector of a template: the TF-IDF-weighted mean of its words' vectors
  (words: letters of the template, camel case split, lower case; IDF over the templates of the
  train lines). Departure: the word vectors are **hashed**, a fixed random Gaussian vector per
  word drawn from a hash of the word (64 dimensions), where the paper uses pre-trained FastText
  vectors (300): words shared between templates are shared, but no similarity between different
  words is known. An empty step is the sequence of one zero vector.
- **LAnoBERT** (Lee et al., 2023; ``lanobert``): a small BERT-style masked language model
  (2 post-norm transformer layers, d = 64, 4 heads, learned positions) trained from scratch on
  the **normal** train steps' raw lines, with no parser: the message is lower-cased and split
  into words and punctuation after regex masking of ids and numbers
  (:func:`teller.logs.templates.mask`, the kind of minimal preprocessing LAnoBERT applies instead
  of parsing). 15% of the tokens are masked in training. Score of a line: the mean of its top-5
  masked-token losses (−log p of the true token); of a step: the largest of its lines'. Departure:
  the paper masks every token alone (one pass per token); here token ``j`` is masked in pass
  ``j mod 6`` (six passes per line, each masking about a sixth), and the model is small
  (no pre-training corpus). An empty step scores 0 (no line, no loss).
- **Logs2Graphs** (Li et al., 2023; ``logs2graphs``): one directed graph per step, nodes = the
  templates of its lines (features: the template's semantic vector, as LogRobust's, and
  ``log1p`` of its line count), an edge ``a → b`` weighted by how often a line of ``b``
  follows one of ``a``. Two message-passing layers (self, in- and out-neighbours by normalised
  edge weight, as the digraph inception convolution of the paper does, one hop), mean + max
  pooling, a linear classifier. Departure: the paper's OCDiGCN is one-class (an SVDD objective
  on normal graphs); here it is a **supervised** graph classifier (class-weighted cross entropy),
  as the evaluation asks for a graph neural network classifier. An empty step is a graph with no
  node: its pooled embedding is zero.
- **MAD-GAN** (Li et al., ICANN 2019; ``madgan``): per step, the vector of ``log1p`` line counts
  of each template seen in the normal train lines (one more column for templates never seen
  there), divided by the column's largest value on the fitted steps (at least 1: a min-max
  scaling, as the paper scales its series); the window of a step is its own and its previous ``window - 1`` steps'
  vectors in the run (the dataset's kept steps in step order; zeros before the run's first). An
  LSTM generator (latent sequence → window) and an LSTM discriminator (window → real
  probability per position) are trained as a GAN on the windows ending at normal train steps.
  Score (DR-score): ``λ · R / mean R_cal + (1 − λ) · (1 − D)`` at the window's last position,
  ``λ = 0.5``, ``R`` the squared error of the best reconstruction ``G(z)`` found by 30 Adam steps
  on ``z`` (latent inversion), ``D`` the discriminator's output on the real window. Departures:
  template counts per step replace the paper's multivariate sensor series; windows follow the
  kept steps (gaps where steps were not kept); the inversion is a few gradient steps from one
  seeded start. An empty step is a zero count vector.

Thresholds: the supervised methods flag a step whose abnormal probability is ≥ 0.5. The two
unsupervised ones (fitted on normal train steps) hold out a fifth of the normal train steps
(seeded) from training and flag a step whose score exceeds the 95th percentile of those
held-out steps' scores (``threshold_``), as the classical one-class methods use their 95th.
"""

from __future__ import annotations

import contextlib
import re
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from teller.baselines.base import Method, Prediction, register
from teller.baselines.steps import StepSet, _ranges
from teller.errors import InputError
from teller.rundir import str_array

# ------------------------------------------------------------------------------------------------
# the lines of each step


@dataclass
class StepLogs:
    """The log lines of every step of a :class:`StepSet`, in time order: step ``i`` has the lines
    ``ptr[i]:ptr[i + 1]``; ``template`` codes index ``templates``; ``message`` is the raw text."""

    ptr: np.ndarray
    template: np.ndarray
    templates: list[str]
    message: np.ndarray

    def lens(self) -> np.ndarray:
        return np.diff(self.ptr)


def step_logs(steps: StepSet) -> StepLogs:
    """The lines of ``steps`` from ``logs.parquet`` of its dataset (cached in ``steps.extra``)."""
    if "logs" in steps.extra:
        return steps.extra["logs"]
    path = Path(steps.dataset) / "logs.parquet"
    if not path.is_file():
        raise InputError(path, "no such file", "the log baselines need the dataset's aligned log lines")
    t = pq.read_table(path, columns=["run_id", "step_id", "ts_ns", "line_no", "message", "template"])
    run = str_array(t.column("run_id"))
    code = np.searchsorted(steps.runs, run)
    ok = (code < len(steps.runs)) & (steps.runs[np.minimum(code, len(steps.runs) - 1)] == run)
    sid = t.column("step_id").to_numpy()
    key = code.astype(np.int64) << 40 | np.maximum(sid, 0)
    unit = np.searchsorted(steps.unit_key, key)
    ok &= (sid >= 0) & (unit < len(steps.unit_key))
    ok &= steps.unit_key[np.minimum(unit, len(steps.unit_key) - 1)] == key
    rows = np.flatnonzero(ok)
    unit = unit[rows]
    ts = t.column("ts_ns").to_numpy()[rows]
    ln = t.column("line_no").to_numpy()[rows]
    by_unit = rows[np.lexsort((ln, ts, unit))]
    unit_sorted = np.sort(unit)
    u_start = np.searchsorted(unit_sorted, np.arange(len(steps.unit_key)))
    u_len = np.searchsorted(unit_sorted, np.arange(len(steps.unit_key)), side="right") - u_start
    # (step, unit) pairs → their lines, then time order within the step
    pair_step = np.repeat(np.arange(steps.n), np.diff(steps.unit_ptr))
    pair_unit = steps.unit_idx
    n_lines = u_len[pair_unit]
    line_pos = _ranges(u_start[pair_unit], n_lines)
    line_row = by_unit[line_pos]
    line_step = np.repeat(pair_step, n_lines)
    all_ts, all_ln = t.column("ts_ns").to_numpy(), t.column("line_no").to_numpy()
    order = np.lexsort((all_ln[line_row], all_ts[line_row], line_step))
    line_row, line_step = line_row[order], line_step[order]
    tmpl = t.column("template").cast(pa.string()).fill_null("").take(pa.array(line_row)).combine_chunks().dictionary_encode()
    out = StepLogs(ptr=np.searchsorted(line_step, np.arange(steps.n + 1)).astype(np.int64),
                   template=tmpl.indices.to_numpy(zero_copy_only=False).astype(np.int64),
                   templates=tmpl.dictionary.to_pylist(),
                   message=str_array(t.column("message").take(pa.array(line_row))))
    steps.extra["logs"] = out
    return out


def _lines(lg: StepLogs, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Line indices of the steps ``idx`` (concatenated) and their lengths."""
    lens = lg.lens()[idx]
    return _ranges(lg.ptr[idx], lens), lens


# ------------------------------------------------------------------------------------------------
# torch helpers


@contextlib.contextmanager
def _torch(seed: int) -> Iterator[Any]:
    """One CPU thread and a seeded generator, the caller's threads and RNG state restored."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            yield torch
    finally:
        torch.set_num_threads(threads)


def _update(opt: Any, loss: Any) -> None:
    """One optimiser step on ``loss``."""
    opt.zero_grad()
    loss.backward()
    opt.step()


def _threshold_predict(self: Any, steps: StepSet, idx: np.ndarray) -> Prediction:
    """``predict`` of the scoring methods (LAnoBERT, MAD-GAN): the score, flagged above the
    threshold fitted on the calibration steps."""
    with _torch(self.seed) as torch:
        s = self._score(torch, steps, np.asarray(idx))
    return Prediction(score=s, flag=s > self.threshold_)


def _words(template: str) -> list[str]:
    s = re.sub(r"<[A-Z]+>|<\*>", " ", template)
    s = re.sub(r"([a-z])([A-Z])", r"\1 \2", s)
    return re.findall(r"[a-z]+", s.lower())


def _word_vector(word: str, dim: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng([zlib.crc32(word.encode()), seed])
    return rng.standard_normal(dim) / np.sqrt(dim)


class TemplateVectors:
    """TF-IDF-weighted mean of hashed word vectors of each template (LogRobust's semantic vectors)."""

    def __init__(self, dim: int = 64, seed: int = 0):
        self.dim, self.seed = dim, seed

    def fit(self, templates: list[str]) -> "TemplateVectors":
        docs = [set(_words(t)) for t in templates]
        self.n_docs_ = len(docs)
        self.df_: dict[str, int] = {}
        for d in docs:
            for w in d:
                self.df_[w] = self.df_.get(w, 0) + 1
        return self

    def transform(self, templates: list[str]) -> np.ndarray:
        out = np.zeros((len(templates), self.dim), np.float32)
        for i, t in enumerate(templates):
            ws = _words(t)
            if not ws:
                continue
            uniq, cnt = np.unique(ws, return_counts=True)
            idf = np.array([np.log((1 + self.n_docs_) / (1 + self.df_.get(w, 0))) + 1.0 for w in uniq])
            w = cnt / len(ws) * idf
            vec = np.stack([_word_vector(x, self.dim, self.seed) for x in uniq.tolist()])
            out[i] = (w[:, None] * vec).sum(0) / w.sum()
        return out


def _class_weights(y: np.ndarray) -> np.ndarray:
    n1 = max(int(y.sum()), 1)
    n0 = max(int(len(y) - y.sum()), 1)
    return np.array([len(y) / (2 * n0), len(y) / (2 * n1)], np.float32)


def _split_calibration(steps: StepSet, idx: np.ndarray, seed: int, frac: float = 0.2) -> tuple[np.ndarray, np.ndarray]:
    """Normal steps of ``idx``, split (seeded) into a fit part and a held-out calibration part."""
    normal = np.asarray(idx)[~steps.is_anomaly[idx]]
    if len(normal) < 2:
        raise ValueError(f"{len(normal)} normal train steps: too few to fit and calibrate a one-class log model")
    perm = np.random.default_rng(seed).permutation(len(normal))
    k = max(1, int(round(frac * len(normal))))
    return np.sort(normal[perm[k:]]), np.sort(normal[perm[:k]])


# ------------------------------------------------------------------------------------------------
# LogRobust


class _AttnBiLSTM:
    @staticmethod
    def build(torch: Any, dim: int, hidden: int) -> Any:
        nn = torch.nn

        class Net(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.lstm = nn.LSTM(dim, hidden, batch_first=True, bidirectional=True)
                self.att = nn.Linear(2 * hidden, 1)
                self.out = nn.Linear(2 * hidden, 2)

            def forward(self, x: Any, lens: Any) -> Any:
                packed = nn.utils.rnn.pack_padded_sequence(x, lens, batch_first=True, enforce_sorted=False)
                h, _ = self.lstm(packed)
                h, _ = nn.utils.rnn.pad_packed_sequence(h, batch_first=True, total_length=x.shape[1])
                a = self.att(torch.tanh(h)).squeeze(-1)
                pad = torch.arange(x.shape[1])[None, :] >= lens[:, None]
                a = torch.softmax(a.masked_fill(pad, -1e9), dim=1)
                return self.out((a.unsqueeze(-1) * h).sum(1))

        return Net()


class _LogMethod(Method):
    kind = "supervised"
    features = "log lines"
    fit_on = "all train steps (labels)"


@register("logrobust")
class LogRobust(_LogMethod):
    label = "LogRobust"
    features = "log template vectors"

    def __init__(self, seed: int = 0, dim: int = 64, hidden: int = 32, max_lines: int = 64, updates: int = 600,
                 batch: int = 64, lr: float = 2e-3):
        self.seed, self.dim, self.hidden, self.max_lines = seed, dim, hidden, max_lines
        self.updates, self.batch, self.lr = updates, batch, lr

    def _seqs(self, steps: StepSet, idx: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(steps, max_lines, dim) padded template vectors and lengths (an empty step: one zero vector)."""
        lg = step_logs(steps)
        V = self.vectors_.transform(lg.templates)
        lens = np.minimum(lg.lens()[idx], self.max_lines)
        X = np.zeros((len(idx), max(int(lens.max(initial=0)), 1), self.dim), np.float32)
        rows = _ranges(lg.ptr[idx], lens)
        X[np.repeat(np.arange(len(idx)), lens), _ranges(np.zeros(len(idx), np.int64), lens)] = V[lg.template[rows]]
        return X, np.maximum(lens, 1)

    def fit(self, steps: StepSet, idx: np.ndarray) -> "LogRobust":
        idx = np.asarray(idx)
        lg = step_logs(steps)
        rows, _ = _lines(lg, idx)
        seen = np.unique(lg.template[rows])
        self.vectors_ = TemplateVectors(self.dim, self.seed).fit([lg.templates[i] for i in seen.tolist()])
        X, lens = self._seqs(steps, idx)
        y = steps.is_anomaly[idx].astype(np.int64)
        with _torch(self.seed) as torch:
            net = _AttnBiLSTM.build(torch, self.dim, self.hidden)
            opt = torch.optim.Adam(net.parameters(), lr=self.lr)
            loss_fn = torch.nn.CrossEntropyLoss(weight=torch.from_numpy(_class_weights(y)))
            Xt, Lt, yt = torch.from_numpy(X), torch.from_numpy(lens), torch.from_numpy(y)
            rng = np.random.default_rng(self.seed)
            for _ in range(self.updates):
                b = torch.from_numpy(rng.integers(0, len(idx), min(self.batch, len(idx))))
                loss = loss_fn(net(Xt[b], Lt[b]), yt[b])
                _update(opt, loss)
            self.net_ = net
        self.fitted_steps_ = int(len(idx))
        return self

    def predict(self, steps: StepSet, idx: np.ndarray) -> Prediction:
        X, lens = self._seqs(steps, np.asarray(idx))
        with _torch(self.seed) as torch, torch.no_grad():
            self.net_.eval()
            p = torch.softmax(self.net_(torch.from_numpy(X), torch.from_numpy(lens)), 1)[:, 1].numpy()
        p = p.astype(np.float64)
        return Prediction(score=p, flag=p >= 0.5)


# ------------------------------------------------------------------------------------------------
# LAnoBERT

PAD, UNK, MASK = 0, 1, 2


def _tokens(message: str) -> list[str]:
    return re.findall(r"<[a-z]+>|[a-z]+|\d|[^\sa-z\d]", message.lower())


@register("lanobert")
class LAnoBERT(Method):
    label = "LAnoBERT"
    kind = "unsupervised"
    features = "raw log text"
    fit_on = "normal train steps (4/5; 1/5 sets the threshold)"

    def __init__(self, seed: int = 0, dim: int = 64, layers: int = 2, heads: int = 4, max_tokens: int = 48,
                 updates: int = 400, batch: int = 64, lr: float = 1e-3, mask_rate: float = 0.15, passes: int = 6,
                 top_k: int = 5, quantile: float = 0.95):
        self.seed, self.dim, self.layers, self.heads, self.max_tokens = seed, dim, layers, heads, max_tokens
        self.updates, self.batch, self.lr, self.mask_rate = updates, batch, lr, mask_rate
        self.passes, self.top_k, self.quantile = passes, top_k, quantile

    def _encode(self, messages: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Distinct masked messages as token ids (padded) and the code of each message."""
        from teller.logs.templates import mask

        masked = mask(pa.array(messages.tolist(), pa.string())).dictionary_encode()
        texts = masked.dictionary.to_pylist()
        codes = masked.indices.to_numpy(zero_copy_only=False).astype(np.int64)
        T = np.full((len(texts), self.max_tokens), PAD, np.int64)
        for i, s in enumerate(texts):
            ids = [self.vocab_.get(w, UNK) for w in _tokens(s)][: self.max_tokens]
            T[i, : len(ids)] = ids
        return T, codes

    def _net(self, torch: Any) -> Any:
        nn = torch.nn
        dim, n_vocab, max_tokens = self.dim, len(self.vocab_) + 3, self.max_tokens

        class MLM(nn.Module):
            def __init__(s, layers: int, heads: int) -> None:
                super().__init__()
                s.tok = nn.Embedding(n_vocab, dim, padding_idx=PAD)
                s.pos = nn.Embedding(max_tokens, dim)
                layer = nn.TransformerEncoderLayer(dim, heads, 2 * dim, dropout=0.1, activation="gelu", batch_first=True)
                s.enc = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
                s.norm = nn.LayerNorm(dim)
                s.head = nn.Linear(dim, n_vocab)

            def forward(s, x: Any) -> Any:
                h = s.norm(s.tok(x) + s.pos(torch.arange(x.shape[1]))[None])
                return s.head(s.enc(h, src_key_padding_mask=x == PAD))

        return MLM(self.layers, self.heads)

    def _line_scores(self, torch: Any, T: np.ndarray) -> np.ndarray:
        """Top-k mean of the masked-token losses of each tokenised line."""
        out = np.zeros(len(T))
        self.net_.eval()
        with torch.no_grad():
            for s in range(0, len(T), 256):
                x = torch.from_numpy(T[s:s + 256])
                real = x != PAD
                loss = torch.zeros(x.shape, dtype=torch.float32)
                pos = torch.arange(x.shape[1])[None, :].expand_as(x)
                for k in range(self.passes):
                    m = real & (pos % self.passes == k)
                    logp = torch.log_softmax(self.net_(x.masked_fill(m, MASK)), -1)
                    nll = -logp.gather(-1, x.unsqueeze(-1)).squeeze(-1)
                    loss = torch.where(m, nll, loss)
                top = torch.topk(loss.masked_fill(~real, -1.0), min(self.top_k, x.shape[1]), dim=1).values
                ok = top >= 0
                out[s:s + 256] = ((top.clamp_min(0) * ok).sum(1) / ok.sum(1).clamp_min(1)).numpy()
        return out

    def _score(self, torch: Any, steps: StepSet, idx: np.ndarray) -> np.ndarray:
        lg = step_logs(steps)
        rows, lens = _lines(lg, idx)
        score = np.zeros(len(idx))
        if len(rows):
            T, codes = self._encode(lg.message[rows])
            line = self._line_scores(torch, T)[codes]
            which = np.repeat(np.arange(len(idx)), lens)
            np.maximum.at(score, which, line)
        return score

    def fit(self, steps: StepSet, idx: np.ndarray) -> "LAnoBERT":
        from teller.logs.templates import mask

        fit_idx, cal_idx = _split_calibration(steps, np.asarray(idx), self.seed)
        lg = step_logs(steps)
        rows, _ = _lines(lg, fit_idx)
        if not len(rows):
            raise ValueError("LAnoBERT: the normal train steps have no log line to learn from")
        masked = mask(pa.array(lg.message[rows].tolist(), pa.string())).to_pylist()
        counts: dict[str, int] = {}
        for s in masked:
            for w in _tokens(s):
                counts[w] = counts.get(w, 0) + 1
        self.vocab_ = {w: i + 3 for i, w in enumerate(sorted(counts))}
        T, codes = self._encode(lg.message[rows])
        with _torch(self.seed) as torch:
            self.net_ = net = self._net(torch)
            opt = torch.optim.Adam(net.parameters(), lr=self.lr)
            rng = np.random.default_rng(self.seed)
            for _ in range(self.updates):
                net.train()
                x = torch.from_numpy(T[codes[rng.integers(0, len(codes), self.batch)]])
                m = (x != PAD) & (torch.rand(x.shape) < self.mask_rate)
                m[:, 0] |= ~m.any(1)  # at least one masked token per line
                m &= x != PAD
                logits = net(x.masked_fill(m, MASK))
                loss = torch.nn.functional.cross_entropy(logits[m], x[m])
                _update(opt, loss)
            cal = self._score(torch, steps, cal_idx)
        self.threshold_ = float(np.quantile(cal, self.quantile))
        self.fitted_steps_ = int(len(fit_idx))
        return self

    predict = _threshold_predict


# ------------------------------------------------------------------------------------------------
# Logs2Graphs


@dataclass
class _Graphs:
    """Graphs of a set of steps: nodes (graph, template, count), directed weighted edges."""

    node_graph: np.ndarray
    node_template: np.ndarray
    node_count: np.ndarray
    src: np.ndarray
    dst: np.ndarray
    weight: np.ndarray
    n: int


def step_graphs(steps: StepSet, idx: np.ndarray) -> _Graphs:
    """One template graph per step of ``idx``: nodes = its templates, an edge per consecutive pair of lines."""
    lg = step_logs(steps)
    rows, lens = _lines(lg, idx)
    g = np.repeat(np.arange(len(idx), dtype=np.int64), lens)
    t = lg.template[rows]
    key = g << 20 | t
    nodes, node_of, count = np.unique(key, return_inverse=True, return_counts=True)
    node_of = node_of.reshape(-1)
    same = g[1:] == g[:-1]
    ek = node_of[:-1][same].astype(np.int64) << 32 | node_of[1:][same]
    edges, w = np.unique(ek, return_counts=True)
    return _Graphs(node_graph=nodes >> 20, node_template=nodes & ((1 << 20) - 1), node_count=count,
                   src=edges >> 32, dst=edges & ((1 << 32) - 1), weight=w.astype(np.float32), n=len(idx))


@register("logs2graphs")
class Logs2Graphs(_LogMethod):
    label = "Logs2Graphs"
    features = "log template graphs"

    def __init__(self, seed: int = 0, dim: int = 64, hidden: int = 64, updates: int = 300, lr: float = 5e-3):
        self.seed, self.dim, self.hidden, self.updates, self.lr = seed, dim, hidden, updates, lr

    def _net(self, torch: Any) -> Any:
        nn = torch.nn
        d_in, h = self.dim + 1, self.hidden

        class DiGNN(nn.Module):
            def __init__(s) -> None:
                super().__init__()
                s.layers = nn.ModuleList([nn.ModuleList([nn.Linear(a, h) for _ in range(3)]) for a in (d_in, h)])
                s.out = nn.Linear(2 * h, 2)

            def forward(s, x: Any, src: Any, dst: Any, w: Any, graph: Any, n: int) -> Any:
                nn_ = x.shape[0]
                w_in = w / torch.zeros(nn_).index_add_(0, dst, w).clamp_min(1e-9)[dst]  # normalised over a node's in-edges
                w_out = w / torch.zeros(nn_).index_add_(0, src, w).clamp_min(1e-9)[src]
                for self_l, in_l, out_l in s.layers:
                    agg_in = torch.zeros(nn_, x.shape[1]).index_add_(0, dst, w_in[:, None] * x[src])
                    agg_out = torch.zeros(nn_, x.shape[1]).index_add_(0, src, w_out[:, None] * x[dst])
                    x = torch.relu(self_l(x) + in_l(agg_in) + out_l(agg_out))
                cnt = torch.zeros(n).index_add_(0, graph, torch.ones(nn_)).clamp_min(1)
                mean = torch.zeros(n, x.shape[1]).index_add_(0, graph, x) / cnt[:, None]
                mx = torch.zeros(n, x.shape[1]).scatter_reduce(0, graph[:, None].expand_as(x), x, "amax")
                return s.out(torch.cat([mean, mx], 1))

        return DiGNN()

    def _tensors(self, torch: Any, steps: StepSet, idx: np.ndarray) -> tuple[Any, ...]:
        g = step_graphs(steps, idx)
        V = self.vectors_.transform(step_logs(steps).templates)
        x = np.concatenate([V[g.node_template], np.log1p(g.node_count)[:, None].astype(np.float32)], 1)
        return (torch.from_numpy(x), torch.from_numpy(g.src), torch.from_numpy(g.dst), torch.from_numpy(g.weight),
                torch.from_numpy(g.node_graph), g.n)

    def fit(self, steps: StepSet, idx: np.ndarray) -> "Logs2Graphs":
        idx = np.asarray(idx)
        lg = step_logs(steps)
        rows, _ = _lines(lg, idx)
        seen = np.unique(lg.template[rows])
        self.vectors_ = TemplateVectors(self.dim, self.seed).fit([lg.templates[i] for i in seen.tolist()])
        y = steps.is_anomaly[idx].astype(np.int64)
        with _torch(self.seed) as torch:
            net = self._net(torch)
            inputs = self._tensors(torch, steps, idx)
            opt = torch.optim.Adam(net.parameters(), lr=self.lr)
            loss_fn = torch.nn.CrossEntropyLoss(weight=torch.from_numpy(_class_weights(y)))
            yt = torch.from_numpy(y)
            for _ in range(self.updates):  # full batch: every train graph in each update
                loss = loss_fn(net(*inputs), yt)
                _update(opt, loss)
            self.net_ = net
        self.fitted_steps_ = int(len(idx))
        return self

    def predict(self, steps: StepSet, idx: np.ndarray) -> Prediction:
        with _torch(self.seed) as torch, torch.no_grad():
            p = torch.softmax(self.net_(*self._tensors(torch, steps, np.asarray(idx))), 1)[:, 1].numpy()
        p = p.astype(np.float64)
        return Prediction(score=p, flag=p >= 0.5)


# ------------------------------------------------------------------------------------------------
# MAD-GAN


@register("madgan")
class MADGAN(Method):
    label = "MAD-GAN"
    kind = "unsupervised"
    features = "log template counts (windows of steps)"
    fit_on = "normal train steps (4/5; 1/5 sets the threshold)"

    def __init__(self, seed: int = 0, window: int = 6, latent: int = 8, hidden: int = 32, updates: int = 600,
                 batch: int = 64, lr: float = 1e-3, inversion_steps: int = 30, lam: float = 0.5,
                 quantile: float = 0.95):
        self.seed, self.window, self.latent, self.hidden, self.updates = seed, window, latent, hidden, updates
        self.batch, self.lr, self.inversion_steps, self.lam, self.quantile = batch, lr, inversion_steps, lam, quantile

    def _counts(self, steps: StepSet) -> np.ndarray:
        """(steps, templates + 1) log1p line counts of every step of ``steps``."""
        lg = step_logs(steps)
        col = np.full(len(lg.templates), len(self.columns_), np.int64)
        col[self.columns_] = np.arange(len(self.columns_))
        C = np.zeros((steps.n, len(self.columns_) + 1), np.float32)
        g = np.repeat(np.arange(steps.n), lg.lens())
        np.add.at(C, (g, col[lg.template]), 1.0)
        return np.log1p(C)

    def _windows(self, steps: StepSet, X: np.ndarray, idx: np.ndarray) -> np.ndarray:
        """(len(idx), window, features): each step's own and previous steps' vectors in its run."""
        order = np.lexsort((steps.step_num, steps.run_code))
        rank = np.empty(steps.n, np.int64)
        rank[order] = np.arange(steps.n)
        W = np.zeros((len(idx), self.window, X.shape[1]), np.float32)
        for k in range(self.window):  # position window-1-k: k steps back
            r = rank[idx] - k
            prev = order[np.maximum(r, 0)]
            ok = (r >= 0) & (steps.run_code[prev] == steps.run_code[idx])
            W[ok, self.window - 1 - k] = X[prev[ok]] / self.scale_
        return W

    def _nets(self, torch: Any, n_feat: int) -> tuple[Any, Any]:
        nn = torch.nn
        latent, hidden = self.latent, self.hidden

        class Gen(nn.Module):
            def __init__(s) -> None:
                super().__init__()
                s.lstm = nn.LSTM(latent, hidden, batch_first=True)
                s.out = nn.Linear(hidden, n_feat)

            def forward(s, z: Any) -> Any:
                return s.out(s.lstm(z)[0])

        class Disc(nn.Module):
            def __init__(s) -> None:
                super().__init__()
                s.lstm = nn.LSTM(n_feat, hidden, batch_first=True)
                s.out = nn.Linear(hidden, 1)

            def forward(s, x: Any) -> Any:
                return s.out(s.lstm(x)[0]).squeeze(-1)  # logits per position

        return Gen(), Disc()

    def _raw_scores(self, torch: Any, W: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Reconstruction error and 1 − D at the last position of each window."""
        x = torch.from_numpy(W)
        with torch.no_grad():
            d = torch.sigmoid(self.disc_(x))[:, -1].numpy()
        g = torch.Generator().manual_seed(self.seed + 1)
        z = torch.randn(len(W), self.window, self.latent, generator=g).requires_grad_(True)
        opt = torch.optim.Adam([z], lr=0.1)
        for p in self.gen_.parameters():
            p.requires_grad_(False)
        for _ in range(self.inversion_steps):
            loss = ((self.gen_(z) - x) ** 2).mean(2).sum()
            _update(opt, loss)
        with torch.no_grad():
            r = ((self.gen_(z) - x) ** 2).mean(2)[:, -1].numpy()
        return r.astype(np.float64), (1.0 - d).astype(np.float64)

    def _score(self, torch: Any, steps: StepSet, idx: np.ndarray) -> np.ndarray:
        r, d = self._raw_scores(torch, self._windows(steps, self._counts(steps), idx))
        return self.lam * r / self.r_scale_ + (1 - self.lam) * d

    def fit(self, steps: StepSet, idx: np.ndarray) -> "MADGAN":
        fit_idx, cal_idx = _split_calibration(steps, np.asarray(idx), self.seed)
        lg = step_logs(steps)
        rows, _ = _lines(lg, fit_idx)
        self.columns_ = np.unique(lg.template[rows])
        X = self._counts(steps)
        self.scale_ = np.maximum(X[fit_idx].max(0), 1.0).astype(np.float32)
        W = self._windows(steps, X, fit_idx)
        with _torch(self.seed) as torch:
            gen, disc = self._nets(torch, X.shape[1])
            og = torch.optim.Adam(gen.parameters(), lr=self.lr)
            od = torch.optim.Adam(disc.parameters(), lr=self.lr)
            bce = torch.nn.functional.binary_cross_entropy_with_logits
            torch_w = torch.from_numpy(W)
            rng = np.random.default_rng(self.seed)
            for _ in range(self.updates):
                real = torch_w[torch.from_numpy(rng.integers(0, len(W), self.batch))]
                z = torch.randn(len(real), self.window, self.latent)
                fake = gen(z)
                ld = bce(disc(real), torch.ones(real.shape[:2])) + bce(disc(fake.detach()), torch.zeros(real.shape[:2]))
                _update(od, ld)
                lgen = bce(disc(fake), torch.ones(real.shape[:2]))
                _update(og, lgen)
            self.gen_, self.disc_ = gen.eval(), disc.eval()
            r_cal, d_cal = self._raw_scores(torch, self._windows(steps, X, cal_idx))
            self.r_scale_ = max(float(r_cal.mean()), 1e-6)
            cal = self.lam * r_cal / self.r_scale_ + (1 - self.lam) * d_cal
        self.threshold_ = float(np.quantile(cal, self.quantile))
        self.fitted_steps_ = int(len(fit_idx))
        return self

    predict = _threshold_predict


#: the log baselines, in table order
LOG_METHODS = ("logrobust", "lanobert", "logs2graphs", "madgan")
