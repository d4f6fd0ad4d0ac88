"""Where a decoder keeps its token embedding, the norms outside its blocks and its absolute position table, as paths
from the base model (:func:`embedding_places`, for :func:`~mfpipe.models.adapters.structure.describe`):

* beside the blocks, a child of the module that holds them (most decoders: ``embed_tokens`` beside ``layers``; OPT's
  ``decoder.embed_tokens``), its position table a child too (GPT-2's ``wpe``);
* one level down, in a child of that module that holds it with its norms (ModernBERT-decoder's ``embeddings``:
  ``tok_embeddings``, ``norm``, a dropout);
* in a module of the base model beside the module that holds the blocks, with its norm and a position table (GIT's
  ``embeddings``: ``word_embeddings``, ``position_embeddings``, ``LayerNorm``, beside ``encoder``, which holds the
  blocks: BERT's layout, its token-type table left out, which a decoder has not).

The probe decides which norm is the embedding's and which the final one, and checks the position table against what
block 0 reads (:func:`~mfpipe.models.adapters.residual.embed_scale`)."""

from __future__ import annotations

from torch import nn

from mfpipe.models.adapters.probe import UnsupportedArchitectureError, is_norm, submodule
from mfpipe.models.adapters.residual import position_tables, table_rows

__all__ = ["embedding_places", "nested_embedding"]


def nested_embedding(children: dict, emb: nn.Module, d: int = 0,
                     n_pos=None) -> tuple[str, list[str], list[str]] | None:
    """Where the token embedding ``emb`` sits one level down, in one of ``children`` that holds it, norms,
    parameter-free modules and at most an absolute position table (``d`` wide rows, as many as the ``n_pos``
    positions) only: (its path, the paths of those norms, for the probe to place as the embedding's, the table's);
    None elsewhere (BERT's embeddings hold a token-type table besides: an encoder's)."""
    for n, c in children.items():
        kids = dict(c.named_children())
        inner = [k for k, m in kids.items() if m is emb]
        tables = [k for k, m in kids.items() if m is not emb and isinstance(m, nn.Embedding)
                  and (t := table_rows(m)) is not None and t.shape[1] == d and isinstance(n_pos, int)
                  and 0 <= t.shape[0] - n_pos <= 2]
        if len(inner) == 1 and len(tables) <= 1 and all(
                m is emb or k in tables or is_norm(m) or not any(True for _ in m.parameters()) for k, m in kids.items()):
            return (f"{n}.{inner[0]}", [f"{n}.{k}" for k, m in kids.items() if m is not emb and is_norm(m)],
                    [f"{n}.{k}" for k in tables])
    return None


def embedding_places(base: nn.Module, stack: str, emb: nn.Module | None, d: int, n_pos, mt
                     ) -> tuple[str, list[str], list[str]]:
    """(the token embedding ``emb``'s path, the norms outside the blocks, the candidates for an absolute position
    table), paths from ``base``; ``stack``: the path (with a trailing dot, or "") of the module holding the blocks.
    Raises :class:`UnsupportedArchitectureError` where the embedding sits elsewhere (an encoder's)."""
    stack_mod = submodule(base, stack)
    children = dict(stack_mod.named_children())
    embeds = [n for n, m in children.items() if m is emb]
    norms = [stack + n for n, m in children.items() if is_norm(m) and m is not emb]
    tables = [stack + n for n in position_tables(stack_mod, emb, d, n_pos)]
    if embeds or emb is None:
        if len(embeds) != 1:
            why = "none" if not embeds else f"{len(embeds)} candidates ({', '.join(embeds)})"
            raise UnsupportedArchitectureError(mt, f"cannot place the token embedding: {why}")
        return stack + embeds[0], norms, tables
    nested = nested_embedding(children, emb, d, n_pos)  # ModernBERT-decoder's, with its norm
    where = stack
    if nested is None and stack:  # GIT's: beside the module holding the blocks, with its table and norm
        nested, where = nested_embedding({n: m for n, m in base.named_children() if m is not stack_mod}, emb, d,
                                         n_pos), ""
    if nested is None:  # an encoder's embedding sits in a module of its own (BERT's embeddings)
        at = next((n for n, m in base.named_modules() if m is emb), None)
        raise UnsupportedArchitectureError(mt, f"cannot place the token embedding beside its blocks (it sits in {at})")
    path, inner_norms, inner_tables = nested
    return where + path, norms + [where + n for n in inner_norms], tables + [where + t for t in inner_tables]
