"""Lenses for mean-field analysis (paper App. P, Lens "top-deviation context mining" and Lens "vocabulary-space
decode"; issue 11 item 7): per head, the top-K deviation contexts pass 2 recorded, re-run through the model to show
the surrounding text, the head's top attended keys, the actual next token and the raw logit-lens decode of the
deviation vector (and, given the model's J-lens store, :mod:`mfpipe.jlens`, its J-lens decode beside it), written as
readable tables (Markdown / HTML), one target per lens.

* :func:`mine_contexts` -- the recorded top contexts (``top_D``/``top_shard``/``top_window``/``top_position`` of the
  deviation store, :mod:`mfpipe.deviation.shards`) of the selected heads. App. P's first filter (more than
  ``other_share_max`` = 10% of the attention on ``<other>`` keys) was applied when pass 2 mined them; the second,
  garbled or rare-Unicode text (U+FFFD, control, private-use, unassigned or surrogate characters in the decoded
  excerpt around the query), is applied here.
* :func:`context_details` -- one traced forward per batch of windows (:meth:`Adapter.run`), the per-context math
  of pass 2 (:func:`~mfpipe.meanfield.ccmf.pair_kernel`, :func:`~mfpipe.meanfield.deviation.occurrence_terms`,
  :func:`~mfpipe.meanfield.deviation.meters`) on the rows' heads only, so D is recomputed and checked against ``top_D``
  (the re-run: :class:`~mfpipe.experiments.prompts.rerun.ContextRerun`).
* :func:`contexts_markdown` / :func:`contexts_html` (the context lens) and :func:`decode_markdown` (the decode lens).
  The covariance/contextualization plane (the first lens) is a figure built elsewhere.
"""

from __future__ import annotations

import html
import json
import os
import re
import unicodedata
from collections import Counter

import numpy as np
import pandas as pd

from mfpipe.deviation.pass2 import OTHER_SHARE_MAX
from mfpipe.experiments.prompts.rerun import ContextRerun

__all__ = ["mine_contexts", "context_details", "contexts_markdown", "contexts_html", "decode_markdown",
           "contexts_csv", "parse_heads", "is_garbled", "N_LENS_HEADS", "PER_HEAD", "BEFORE", "AFTER", "D_ATOL"]

N_LENS_HEADS = 8  # heads shown by default: the top-N by S̄
PER_HEAD = 8  # contexts per head (App. P: "the head's eight highest-deviation occurrences")
BEFORE, AFTER = 24, 3  # tokens of context before / after the query in the excerpt
D_ATOL = 1e-5  # the recomputed D must equal the stored top_D to this
BOS_KEY = "⟨bos⟩"
_BAD_CATEGORIES = {"Cc", "Co", "Cn", "Cs"}


def is_garbled(text: str) -> bool:
    """Garbled or rare-Unicode text (App. P): U+FFFD, or a control (other than tab / newline / CR), private-use,
    unassigned or surrogate character."""
    return any(c == "\ufffd" or (c not in "\t\n\r" and unicodedata.category(c) in _BAD_CATEGORIES) for c in text)


def parse_heads(heads) -> list[tuple[int, int]]:
    """``[(l, h), "L9H8", ...]`` -> ``[(l, h), ...]``."""
    out = []
    for x in heads or ():
        if isinstance(x, str):
            m = re.fullmatch(r"\s*L(\d+)\s*H(\d+)\s*", x, flags=re.I)
            if not m:
                raise ValueError(f"head {x!r}: write it as L<layer>H<head>, e.g. L9H8")
            x = (m.group(1), m.group(2))
        out.append((int(x[0]), int(x[1])))
    return out


def _shard_tokens(shards, i: int, cache: dict) -> np.ndarray:
    if i not in cache:
        if not 0 <= i < len(shards):
            raise ValueError(f"the deviation store names shard {i}, but {len(shards)} statistics-half shards "
                             "were given")
        src = shards[i]
        if isinstance(src, (str, bytes)) or hasattr(src, "__fspath__"):
            from mfpipe.corpus.windows import read_shard

            src = read_shard(src).tokens
        cache[i] = np.asarray(src)
    return cache[i]


def window_tokens(shards, rows: pd.DataFrame) -> np.ndarray:
    """``[R, T]`` int64: the window of each row (``shard``, ``window``). ``shards``: the statistics half's sorted
    shard files (or their token arrays ``[n, T]``), or a ``[R, T]`` array already aligned with ``rows``."""
    if isinstance(shards, np.ndarray) and shards.ndim == 2 and len(shards) == len(rows):
        return shards.astype(np.int64)
    cache: dict = {}
    got = [_shard_tokens(shards, int(s), cache)[int(w)] for s, w in zip(rows["shard"], rows["window"])]
    return np.stack(got).astype(np.int64) if got else np.zeros((0, 0), np.int64)


def _decode(tokenizer, ids) -> str:
    return tokenizer.decode([int(i) for i in ids])


def _excerpt(tokenizer, ids: np.ndarray, pos: int, before: int, after: int) -> tuple[str, str, str, str]:
    """(text before the query, the query, text after, the excerpt for the garbled check): ``before`` tokens before
    the query to ``after`` after it, decoded as ONE text (a character split over byte-level tokens stays whole) and
    cut where the decodes up to and through the query diverge from it (a query that is part of a character shows that
    character). Replacement characters at the excerpt's two ends come from cutting a character and are dropped."""
    lo, hi = max(1, pos - before), min(len(ids), pos + 1 + after)
    c0, c1, text = (_decode(tokenizer, ids[lo:e]) for e in (pos, pos + 1, hi))
    a = len(os.path.commonprefix([c0, text]))
    b = min(max(len(os.path.commonprefix([c1, text])), a + 1), len(text))
    left, query, right = text[:a].lstrip("\ufffd"), text[a:b], text[b:].rstrip("\ufffd")
    return ("…" if lo > 1 else "") + left, query, right, left + query + right


def mine_contexts(deviation_ds, shard_paths, heads=None, per_head: int = PER_HEAD, *, n_lens_heads: int = N_LENS_HEADS,
                  tokenizer=None, before: int = BEFORE, after: int = AFTER) -> pd.DataFrame:
    """The recorded top-deviation contexts of the selected heads: the top ``n_lens_heads`` by ``S_bar`` plus ``heads``
    (``[(l, h)]`` or ``["L9H8"]``), up to ``per_head`` each (highest D first), without the garbled windows (their
    excerpt of ``before``/``after`` tokens around the query decodes to garbled text, :func:`is_garbled`; skipped
    without a ``tokenizer``). One row per context: layer, head, rank (in the store), D, shard, window, position,
    and the head's S_bar, S_bar_rank, head_D, head_M_cov, head_M_ctx and n_garbled (dropped)."""
    S = np.asarray(deviation_ds["S_bar"].values, dtype=np.float64)
    L, H = S.shape
    order = [(int(i // H), int(i % H)) for i in np.argsort(-np.where(np.isfinite(S), S, -np.inf), axis=None,
                                                             kind="stable") if np.isfinite(S.flat[i])]
    srank = {lh: r + 1 for r, lh in enumerate(order)}
    chosen = list(dict.fromkeys(order[: int(n_lens_heads)] + parse_heads(heads)))
    for l, h in chosen:
        if not (0 <= l < L and 0 <= h < H):
            raise ValueError(f"head L{l}H{h} is outside the model's {L} layers x {H} heads")
    top = {k: np.asarray(deviation_ds[k].values) for k in ("top_D", "top_window", "top_position", "top_shard")}
    cache: dict = {}
    recs = []
    for l, h in chosen:
        kept, dropped = [], 0
        for r in range(top["top_D"].shape[-1]):
            D, w, p, s = (top[k][l, h, r] for k in ("top_D", "top_window", "top_position", "top_shard"))
            if len(kept) >= int(per_head) or not np.isfinite(D) or w < 0:
                break
            if tokenizer is not None:
                ids = _shard_tokens(shard_paths, int(s), cache)[int(w)]
                if is_garbled(_excerpt(tokenizer, ids, int(p), before, after)[3]):
                    dropped += 1
                    continue
            kept.append(dict(layer=l, head=h, rank=r, D=float(D), shard=int(s), window=int(w), position=int(p)))
        head = dict(S_bar=float(S[l, h]), S_bar_rank=srank.get((l, h), 0),
                    head_D=float(deviation_ds["D"].values[l, h]), head_M_cov=float(deviation_ds["M_cov"].values[l, h]),
                    head_M_ctx=float(deviation_ds["M_ctx"].values[l, h]), n_garbled=dropped)
        recs += [{**k, **head} for k in kept]
    cols = ["layer", "head", "rank", "D", "shard", "window", "position", "S_bar", "S_bar_rank", "head_D",
            "head_M_cov", "head_M_ctx", "n_garbled"]
    return pd.DataFrame.from_records(recs, columns=cols)


def context_details(adapter, kernel, tokenizer, tokens, rows: pd.DataFrame, k_keys: int = 3, decode_k: int = 5,
                    *, before: int = BEFORE, after: int = AFTER, batch_size: int = 8,
                    atol: float = D_ATOL, jlens=None) -> pd.DataFrame:
    """Re-run the windows of ``rows`` (from :func:`mine_contexts`) and add, per row: ``left``/``query``/``right``
    (the excerpt), ``next_token``, the head's top ``k_keys`` attended keys (``key_tokens``, ``key_shares``,
    ``key_positions``), the excerpt token by token with the head's attention on each (``excerpt_tokens``,
    ``excerpt_attention``, the query at ``query_index``) and on BOS (``bos_share``), ``other_share`` (attention on
    ``<other>`` keys), ``D_recomputed`` (``D_ok``: within
    ``atol`` of the stored D), ``M_cov``, ``M_ctx`` (eq:mcov-mctx) and the raw logit-lens decode of the deviation
    vector Δ = z − ẑ in residual-stream units, Δ_resid = Δ O_h (``O_h = out_proj_slices(l)[h]``, no bias; where the
    attention gates its reads, Δ times the model's own gate of the query position first, as z and ẑ enter O_h): the
    top ``decode_k`` tokens of softmax(W_U final_norm(Δ_resid)) (``decode_tokens``, ``decode_ids``,
    ``decode_probs``; :meth:`Adapter.unembed`).

    ``kernel``: the :class:`~mfpipe.meanfield.kernel.MeanFieldKernel` pass 2 used (same ``min_count``);
    ``tokens``: see :func:`window_tokens`. On Gemma-2 / OLMo-2 Δ O_h is taken before the post-attention norm, as
    pass 2's residual units are.

    ``jlens``: the model's J-lens store (:func:`mfpipe.jlens.lens.open_jlens`; None: the raw lens only). With it, the
    J-lens decode of App. P is added beside the raw one (``jlens_tokens``, ``jlens_ids``, ``jlens_probs``): the top
    ``decode_k`` tokens of softmax(W_U final_norm(J_ℓ Δ_resid)), J_ℓ the corpus-averaged same-position Jacobian of
    the final residual with respect to the output of layer ℓ's attention output projection (the ``attn`` point,
    where Δ O_h lands: before any post-attention norm); :func:`mfpipe.jlens.lens.jlens_decode`."""
    rows = rows.reset_index(drop=True)
    R = len(rows)
    win = window_tokens(tokens, rows)
    rerun = ContextRerun(adapter, kernel, rows, win, k_keys, decode_k)
    rerun.run(batch_size, jlens)
    out, pos = rerun.out, rerun.pos
    df = rows.copy()
    df["D_recomputed"] = out["D_recomputed"]
    df["D_ok"] = np.abs(out["D_recomputed"] - rows["D"].to_numpy(np.float64)) <= atol
    for k in ("M_cov", "M_ctx", "other_share", "valid"):
        df[k] = out[k]
    ex = [_excerpt(tokenizer, win[n], int(pos[n]), before, after) for n in range(R)]
    df["left"], df["query"], df["right"] = [e[0] for e in ex], [e[1] for e in ex], [e[2] for e in ex]
    T = win.shape[1]
    df["next_token"] = [_decode(tokenizer, win[n, pos[n] + 1 : pos[n] + 2]) if pos[n] + 1 < T else "" for n in range(R)]
    df["key_positions"] = [kp[kp >= 0].tolist() for kp in rerun.kpos]
    df["key_tokens"] = [[BOS_KEY if q == 0 else _decode(tokenizer, win[n, q : q + 1]) for q in rerun.kpos[n] if q >= 0]
                        for n in range(R)]
    df["key_shares"] = [ks[np.isfinite(ks)].tolist() for ks in rerun.kshare]
    # the head's attention on every token of the excerpt, token by token (the explorer's highlighting), and on BOS
    lo = [max(1, int(pos[n]) - before) for n in range(R)]
    hi = [min(T, int(pos[n]) + 1 + after) for n in range(R)]
    df["query_index"] = [int(pos[n]) - lo[n] for n in range(R)]
    df["excerpt_tokens"] = [[_decode(tokenizer, [t]) for t in win[n, lo[n] : hi[n]]] for n in range(R)]
    df["excerpt_attention"] = [rerun.att[n, lo[n] : hi[n]].astype(np.float64).tolist() for n in range(R)]
    df["bos_share"] = [float(rerun.att[n, 0]) for n in range(R)]
    df["decode_ids"] = [d[d >= 0].tolist() for d in rerun.dpos]
    df["decode_tokens"] = [[_decode(tokenizer, [t]) for t in d if t >= 0] for d in rerun.dpos]
    df["decode_probs"] = [p[np.isfinite(p)].tolist() for p in rerun.dprob]
    if jlens is not None:
        df["jlens_ids"] = [d[d >= 0].tolist() for d in rerun.jpos]
        df["jlens_tokens"] = [[_decode(tokenizer, [t]) for t in d if t >= 0] for d in rerun.jpos]
        df["jlens_probs"] = [p[np.isfinite(p)].tolist() for p in rerun.jprob]
    return df


# ---------------------------------------------------------------------------------------------- writers
_MD_ESC = re.compile(r"([\\`*_\[\]|~#$])")


def _visible(s: str) -> str:
    s = s.replace("\r\n", "⏎").replace("\n", "⏎").replace("\r", "⏎").replace("\t", "⇥")
    return "".join(f"U+{ord(c):04X}" if unicodedata.category(c) in _BAD_CATEGORIES else c for c in s)


def md_escape(s: str) -> str:
    """Token text for a Markdown table cell: newlines shown as ⏎, tabs as ⇥, other control characters as U+XXXX,
    Markdown specials (incl. ``|``) backslash-escaped, ``&<>`` as entities."""
    s = _visible(str(s)).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
    return _MD_ESC.sub(r"\\\1", s)


def _tok(s: str) -> str:
    """A token on its own: a leading space shown as ␣ (`` G`` vs ``G``)."""
    return "␣" + s[1:] if s.startswith(" ") else (s or "∅")


def _title(g: pd.DataFrame) -> str:
    r = g.iloc[0]
    return (f"L{r['layer']}H{r['head']} — S̄={r['S_bar']:.3f} (rank {r['S_bar_rank']}), "
            f"M_cov={r['head_M_cov']:.3f}, M_ctx={r['head_M_ctx']:.3f}")


def _note(g: pd.DataFrame) -> str:
    r = g.iloc[0]
    bad = int((~g["D_ok"].astype(bool)).sum()) if "D_ok" in g else 0
    return (f"mean D over all contexts {r['head_D']:.3f}; {len(g)} contexts shown, {int(r['n_garbled'])} dropped "
            f"(garbled "
            f"text)" + (f"; **{bad} with recomputed D ≠ stored D (marked ⚠)**" if bad else ""))


def _keys(r, esc) -> str:
    return ", ".join(f"{esc(_tok(t))} ({s:.2f})" for t, s in zip(r.key_tokens, r.key_shares))


def _decodes(r, esc, probs: bool = False, lens: str = "decode") -> str:
    """The raw logit-lens decode (``lens="decode"``) or the J-lens decode (``"jlens"``) of a row."""
    toks, ps = getattr(r, f"{lens}_tokens"), getattr(r, f"{lens}_probs")
    return ", ".join(esc(_tok(t)) + (f" ({p:.3f})" if probs else "") for t, p in zip(toks, ps))


def _has_jlens(df: pd.DataFrame) -> bool:
    return "jlens_tokens" in df.columns


def _heads(df: pd.DataFrame):
    return df.groupby(["layer", "head"], sort=False)


def _preamble(model: str, revision: str, what: str, md: bool = False, jlens: bool = False,
              other_share_max: float = OTHER_SHARE_MAX) -> list[str]:
    lt, gt = ("&lt;", "&gt;") if md else ("<", ">")
    decode = ("Decodes of Δ = z − ẑ: the raw logit lens softmax(W_U · final_norm(Δ O_h)) and the J-lens "
              "softmax(W_U · final_norm(J_ℓ Δ O_h)), J_ℓ the model's average same-position Jacobian of the final "
              "residual with respect to the output of layer ℓ's attention projection, estimated over the statistics "
              "half (App. P; the two agree at late layers)." if jlens else
              "Decode: raw logit lens softmax(W_U · final_norm(Δ O_h)) of Δ = z − ẑ (no J-lens store given: the J-lens "
              "refinement is not applied).")
    return [f"# {what} — {model} @ {revision}", "",
            "Per head, the highest-deviation contexts (D = 1 − cos(z, ẑ) against the context-conditional mean "
            "field, residual-stream units) mined by pass 2 over the statistics half, without the contexts where the "
            f"head puts more than {100 * other_share_max:g}% of its attention on out-of-vocabulary ({lt}other{gt}) "
            "keys (pass 2's other_share_max) or whose text is "
            "garbled (App. P). " + decode, ""]


def contexts_markdown(df: pd.DataFrame, model: str, revision: str, other_share_max: float = OTHER_SHARE_MAX) -> str:
    """The context lens as Markdown: per head a heading "L{l}H{h} — S̄=…, M_cov=…, M_ctx=…" and a table of its
    contexts (query in «…»), top keys with their attention shares, next token, the decode, and the meters."""
    J = _has_jlens(df)
    lines = _preamble(model, revision, "Top-deviation contexts", md=True, jlens=J, other_share_max=other_share_max)
    for _, g in _heads(df):
        lines += [f"## {_title(g)}", "", _note(g), "", "| # | D | context (query in «») | top keys (share) | next "
                  "| logit-lens decode of Δ |" + (" J-lens decode of Δ |" if J else "") + " M_cov | M_ctx |",
                  "|---|---|---|---|---|---|---|---|" + ("---|" if J else "")]
        for n, r in enumerate(g.itertuples(), 1):
            text = f"{md_escape(r.left)}«{md_escape(r.query)}»{md_escape(r.right)}"
            flag = "" if r.D_ok else " ⚠"
            jl = f" {_decodes(r, md_escape, lens='jlens')} |" if J else ""
            lines.append(f"| {n} | {r.D:.3f}{flag} | {text} | {_keys(r, md_escape)} | {md_escape(_tok(r.next_token))} "
                         f"| {_decodes(r, md_escape)} |{jl} {r.M_cov:+.3f} | {r.M_ctx:+.3f} |")
        lines.append("")
    return "\n".join(lines)


def decode_markdown(df: pd.DataFrame, model: str, revision: str, other_share_max: float = OTHER_SHARE_MAX) -> str:
    """The decode lens as Markdown: per head the logit-lens decode of each context's deviation vector (decoded one
    by one, never averaged: App. P) with probabilities, and the tokens recurring across the head's decodes; with
    the J-lens columns of :func:`context_details` the J-lens decode beside it."""
    J = _has_jlens(df)
    lines = _preamble(model, revision, "Logit-lens and J-lens decodes of the deviation vectors" if J else
                      "Logit-lens decodes of the deviation vectors", md=True, jlens=J, other_share_max=other_share_max)

    def recurring(g, lens):
        text = {i: t for ids, ts in zip(g[f"{lens}_ids"], g[f"{lens}_tokens"]) for i, t in zip(ids, ts)}
        c = Counter(i for ids in g[f"{lens}_ids"] for i in dict.fromkeys(ids))  # by id: byte tokens may print alike
        return ", ".join(f"{md_escape(_tok(text[i]))} ({k}/{len(g)})" for i, k in c.most_common(8) if k > 1) or "none"

    for _, g in _heads(df):
        lines += [f"## {_title(g)}", "", f"Tokens in more than one decode: {recurring(g, 'decode')}", ""]
        if J:
            lines += [f"Tokens in more than one J-lens decode: {recurring(g, 'jlens')}", "",
                      ("| # | D | query | next | logit-lens decode (softmax probability) "
                       "| J-lens decode (softmax probability) |"), "|---|---|---|---|---|---|"]
        else:
            lines += ["| # | D | query | next | decode (softmax probability) |", "|---|---|---|---|---|"]
        for n, r in enumerate(g.itertuples(), 1):
            jl = f" {_decodes(r, md_escape, probs=True, lens='jlens')} |" if J else ""
            lines.append(f"| {n} | {r.D:.3f} | {md_escape(_tok(r.query))} | {md_escape(_tok(r.next_token))} "
                         f"| {_decodes(r, md_escape, probs=True)} |{jl}")
        lines.append("")
    return "\n".join(lines)


def _h(s: str) -> str:
    return html.escape(_visible(str(s)))


def contexts_html(df: pd.DataFrame, model: str, revision: str, other_share_max: float = OTHER_SHARE_MAX) -> str:
    """The context lens as a standalone HTML page (the same tables as :func:`contexts_markdown`, query marked)."""
    J = _has_jlens(df)
    pre = _preamble(model, revision, "Top-deviation contexts", jlens=J, other_share_max=other_share_max)
    body = [f"<h1>{_h(pre[0][2:])}</h1>", f"<p>{_h(pre[2])}</p>"]
    for _, g in _heads(df):
        body += [f"<h2>{_h(_title(g))}</h2>", f"<p>{_h(_note(g).replace('**', ''))}</p>", "<table>",
                 "<tr><th>#</th><th>D</th><th>context</th><th>top keys (share)</th><th>next</th>"
                 "<th>logit-lens decode of Δ</th>" + ("<th>J-lens decode of Δ</th>" if J else "")
                 + "<th>M_cov</th><th>M_ctx</th></tr>"]
        for n, r in enumerate(g.itertuples(), 1):
            jl = f"<td>{_decodes(r, _h, lens='jlens')}</td>" if J else ""
            body.append(f"<tr><td>{n}</td><td>{r.D:.3f}{'' if r.D_ok else ' ⚠'}</td><td>{_h(r.left)}"
                        f"<mark>{_h(r.query)}</mark>{_h(r.right)}</td><td>{_keys(r, _h)}</td>"
                        f"<td>{_h(_tok(r.next_token))}</td>"
                        f"<td>{_decodes(r, _h)}</td>{jl}<td>{r.M_cov:+.3f}</td><td>{r.M_ctx:+.3f}</td></tr>")
        body.append("</table>")
    style = ("body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin-bottom:2em}"
             "td,th{border:1px solid #ccc;padding:3px 6px;vertical-align:top}mark{background:#fd5}")
    return ("<!DOCTYPE html>\n<html><head><meta charset=\"utf-8\"><title>" + _h(pre[0][2:]) + "</title><style>"
            + style + "</style></head><body>\n" + "\n".join(body) + "\n</body></html>\n")


def contexts_csv(df: pd.DataFrame) -> str:
    """The rows as CSV, list columns as JSON."""
    out = df.copy()
    for c in out.columns:
        if len(out) and isinstance(out[c].iloc[0], (list, tuple)):
            out[c] = [json.dumps(x, ensure_ascii=False) for x in out[c]]
    return out.to_csv(index=False)
