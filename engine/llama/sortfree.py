"""The fused temperature sampler's graph without a sort of the vocabulary (engine/llama/fused_dist.py
builds it; docs: its module notes).

Two parts, each a few ggml operations over the step's logits matrix (n_vocab x rows):

* `pooled_top_k`: the exact k best of each row (k <= `POOL_MAX_K`) by maxima, not sorts. A
  row's k best lie in the k chunks with the largest maxima (a chunk outside them has k chunks
  above it, each holding a value above all of its own), so: the maxima of 256-value chunks
  (`ggml_pool_2d`, one pass over the row), the k best of those (a sort of ~600 values), the
  same again inside the kept chunks with 16-value sub-chunks, then one sort of the 16 x k
  survivors. Three small sorts per row, all in one launch each; CUDA's sort of a whole
  151,936-token row (CUB, one row at a time) took ~1 ms a step at any batch.
* `draw`: top-p, min-p and temperature over the k sorted values, then the first token whose
  cumulative probability passes the row's uniform, in fewer operations than llama.cpp's chain
  (min-p compares logits with the best one's; the uniform arrives scaled by `U_SCALE`, so no
  total is taken).
* `rejection`: top-p (and min-p, top-k) over the whole vocabulary, for rows without a top-k,
  after FlashInfer's sorting-free sampling: each row draws `PROPOSALS` tokens from its whole
  distribution at its temperature (inverse CDF over 1,024-token chunks: the chunk, then the
  token, no sort), and keeps the first whose own probability passes the row's cuts (the mass
  of the tokens likelier than it under p, fewer than k of them, at least min-p of the best).
  A proposal so accepted is an exact draw from the cut distribution (the cut set is a top set,
  and the proposal distribution is the uncut one); should every proposal fail (probability at
  most (1 - q)^PROPOSALS, q the mass the cuts keep at the row's temperature: 6e-6 for q = 0.95),
  the row's likeliest token is taken.
"""

from __future__ import annotations

from collections.abc import Callable

POOL = 256  # first-level chunk of `pooled_top_k`
POOL2 = 16  # its second-level chunk
POOL_MAX_K = 64  # 16 x k survivors in one sort of at most 1,024 values
SORT_MAX = 1024  # the longest row a device sorts in one block (CUDA's bitonic argsort)
PROPOSALS = 4  # `rejection`'s tokens drawn per row
CHUNK = 1024  # `rejection`'s inverse-CDF chunk
# The uniform of a row is u x U_SCALE: the cumulative sums of the kept probabilities reach 1
# within a few float steps (at most 64 terms), so a scaled uniform is always passed by the last
# kept token and the draw needs no total; it moves each token's probability by at most 1e-5 of it.
U_SCALE = 1.0 - 1e-5
_F32, _I32 = 0, 26
_SORT_DESC = 1
_POOL_MAX = 0  # enum ggml_op_pool


def pooled(n_vocab: int, k: int) -> bool:
    """Whether `pooled_top_k` can take the k best of a row of `n_vocab`."""
    return 0 < k <= POOL_MAX_K and k <= -(-n_vocab // POOL) <= SORT_MAX and n_vocab < 1 << 24


def _first(g, ctx, order: int, k: int, n: int, n_rows: int) -> int:
    """The first k of each row of an argsort `order` (n x n_rows), contiguous (k x n_rows)."""
    return g["ggml_cont"](ctx, g["ggml_view_2d"](ctx, order, k, n_rows, n * 4, 0))


def pooled_top_k(g: dict[str, Callable], ctx, x: int, n_pad: int, n_rows: int, k: int) -> tuple[int, int]:
    """The k best of each row of `x` (F32, n_pad x n_rows, padded with -inf to a multiple of
    POOL), in descending order: (their values, k x n_rows; their token ids as F32, 1 x k x n_rows)."""
    c1 = n_pad // POOL
    maxima = g["ggml_pool_2d"](ctx, x, _POOL_MAX, POOL, 1, POOL, 1, 0.0, 0.0)  # c1 x n_rows
    top1 = _first(g, ctx, g["ggml_argsort"](ctx, maxima, _SORT_DESC), k, c1, n_rows)  # k chunks a row
    chunks = g["ggml_get_rows"](ctx, g["ggml_reshape_3d"](ctx, x, POOL, c1, n_rows), top1)  # POOL x k x n_rows
    ramp = g["ggml_reshape_2d"](ctx, g["ggml_arange"](ctx, 0.0, float(n_pad), 1.0), POOL, c1)  # token ids
    ids = g["ggml_get_rows"](ctx, ramp, g["ggml_reshape_1d"](ctx, top1, k * n_rows))  # POOL x (k x n_rows)
    c2 = k * POOL // POOL2
    flat = g["ggml_reshape_2d"](ctx, chunks, k * POOL, n_rows)
    maxima2 = g["ggml_pool_2d"](ctx, flat, _POOL_MAX, POOL2, 1, POOL2, 1, 0.0, 0.0)  # c2 x n_rows
    top2 = _first(g, ctx, g["ggml_argsort"](ctx, maxima2, _SORT_DESC), k, c2, n_rows)
    subs = g["ggml_get_rows"](ctx, g["ggml_reshape_3d"](ctx, flat, POOL2, c2, n_rows), top2)  # POOL2 x k x n_rows
    ids = g["ggml_get_rows"](ctx, g["ggml_reshape_3d"](ctx, ids, POOL2, c2, n_rows), top2)
    n = POOL2 * k
    flat = g["ggml_reshape_2d"](ctx, subs, n, n_rows)
    top3 = _first(g, ctx, g["ggml_argsort"](ctx, flat, _SORT_DESC), k, n, n_rows)
    values = g["ggml_get_rows"](ctx, g["ggml_reshape_3d"](ctx, flat, 1, n, n_rows), top3)
    ids = g["ggml_get_rows"](ctx, g["ggml_reshape_3d"](ctx, ids, 1, n, n_rows), top3)  # 1 x k x n_rows
    return g["ggml_reshape_2d"](ctx, values, k, n_rows), ids


def draw(g: dict[str, Callable], ctx, logits: int, ids: int, int_ids: bool, k: int, n_rows: int,
         col: Callable[[int], int], u: int, *, min_p: bool, scale: float | None) -> int:
    """Tokens (I32, n_rows) drawn from the k sorted `logits` of each row (k x n_rows; `ids`
    their token ids, 1 x k x n_rows, I32 or F32): top-p at temperature 1 (column 2), min-p if any
    row asks it (`min_p`; column 6: log(min_p), -1e30 for none), temperature (column 1, or one
    `scale` for every row), then the first token whose cumulative probability passes `u`
    (1 x n_rows, each row's uniform times U_SCALE). Rows that keep fewer than k were masked by
    the caller with -inf."""
    probs = g["ggml_soft_max"](ctx, logits)
    before = g["ggml_sub"](ctx, probs, g["ggml_cumsum"](ctx, probs))  # -(probability before each token)
    keep = g["ggml_step"](ctx, g["ggml_add"](ctx, before, col(2)))  # p - before > 0
    if min_p:  # p_j >= min_p x p_0  <=>  l_j - l_0 >= log(min_p)
        floor = g["ggml_add"](ctx, g["ggml_view_2d"](ctx, logits, 1, n_rows, k * 4, 0), col(6))
        keep = g["ggml_mul"](ctx, keep, g["ggml_step"](ctx, g["ggml_sub"](ctx, logits, floor)))
    mask = g["ggml_log"](ctx, keep)
    if scale is None:
        w = g["ggml_soft_max_ext"](ctx, g["ggml_mul"](ctx, logits, col(1)), mask, 1.0, 0.0)
    else:
        w = g["ggml_soft_max_ext"](ctx, logits, mask, scale, 0.0)
    passed = g["ggml_step"](ctx, g["ggml_scale"](ctx, g["ggml_sub"](ctx, g["ggml_cumsum"](ctx, w), u), -1.0))
    index = g["ggml_cast"](ctx, g["ggml_sum_rows"](ctx, passed), _I32)  # tokens whose cumulative sum < u
    tokens = g["ggml_get_rows"](ctx, ids, index)  # 1 x 1 x n_rows
    if not int_ids:
        tokens = g["ggml_cast"](ctx, tokens, _I32)
    return g["ggml_reshape_1d"](ctx, tokens, n_rows)


def chunk_for(n_vocab: int) -> int:
    """`rejection`'s inverse-CDF chunk for a row of `n_vocab`: CHUNK, or the row for a short one."""
    return min(CHUNK, n_vocab)


def _inverse_cdf(g, ctx, pt: int, n_pad: int, n_rows: int, u: int, size: int) -> int:
    """For each of PROPOSALS uniforms a row (`u`: 1 x PROPOSALS x n_rows, scaled by U_SCALE), the
    token (F32, 1 x PROPOSALS x n_rows) whose cumulative probability first passes it, over the
    row's probabilities `pt` (n_pad x n_rows, zeros past the vocabulary): the chunk of `size`
    tokens by their masses, then the token inside it."""
    n = PROPOSALS
    c = n_pad // size
    mass = g["ggml_reshape_2d"](ctx, g["ggml_sum_rows"](ctx, g["ggml_reshape_2d"](ctx, pt, size, c * n_rows)),
                                c, n_rows)
    cdf = g["ggml_cumsum"](ctx, mass)  # c x n_rows
    wide = g["ggml_repeat"](ctx, g["ggml_reshape_3d"](ctx, cdf, c, 1, n_rows),
                            g["ggml_new_tensor_3d"](ctx, _F32, c, n, n_rows))

    def passed(sums: int, last: int) -> int:  # how many of `sums` lie below u, at most `last`
        below = g["ggml_step"](ctx, g["ggml_scale"](ctx, g["ggml_sub"](ctx, sums, u), -1.0))
        return g["ggml_clamp"](ctx, g["ggml_sum_rows"](ctx, below), 0.0, float(last))

    chunk = passed(wide, c - 1)  # 1 x n x n_rows
    chunk_i = g["ggml_reshape_2d"](ctx, g["ggml_cast"](ctx, chunk, _I32), n, n_rows)
    start = g["ggml_reshape_3d"](ctx, g["ggml_sub"](ctx, cdf, mass), 1, c, n_rows)  # mass before each chunk
    before = g["ggml_get_rows"](ctx, start, chunk_i)  # 1 x n x n_rows
    rows = g["ggml_get_rows"](ctx, g["ggml_reshape_3d"](ctx, pt, size, c, n_rows), chunk_i)  # size x n x n_rows
    lane = passed(g["ggml_add"](ctx, g["ggml_cumsum"](ctx, rows), before), size - 1)
    return g["ggml_add"](ctx, g["ggml_scale"](ctx, chunk, float(size)), lane)


def rejection(g: dict[str, Callable], ctx, lg: int, n_vocab: int, n_pad: int, n_rows: int,
              col: Callable[[int], int], u: int, scale: float | None) -> int:
    """Tokens (I32, n_rows) for rows of `lg` (F32, n_vocab x n_rows) cut by top-p, min-p and
    top-k over the whole vocabulary at temperature 1, drawn at the row's temperature (column 1,
    or one `scale`), by PROPOSALS proposals a row (`u`: PROPOSALS x n_rows uniforms times
    U_SCALE). See the module docstring."""
    n = PROPOSALS
    p1 = g["ggml_soft_max"](ctx, lg)  # the cuts' probabilities, temperature 1
    pt = g["ggml_soft_max"](ctx, g["ggml_mul"](ctx, lg, col(1))) if scale is None else \
        g["ggml_soft_max_ext"](ctx, lg, None, scale, 0.0)
    if n_pad > n_vocab:
        pt = g["ggml_pad"](ctx, pt, n_pad - n_vocab, 0, 0, 0)
    x = _inverse_cdf(g, ctx, pt, n_pad, n_rows,
                     g["ggml_reshape_3d"](ctx, u, 1, n, n_rows), chunk_for(n_vocab))
    x = g["ggml_clamp"](ctx, x, 0.0, float(n_vocab - 1))
    xi = g["ggml_reshape_2d"](ctx, g["ggml_cast"](ctx, x, _I32), n, n_rows)
    px = g["ggml_get_rows"](ctx, g["ggml_reshape_3d"](ctx, p1, 1, n_vocab, n_rows), xi)  # 1 x n x n_rows
    wide = g["ggml_repeat"](ctx, g["ggml_reshape_3d"](ctx, p1, n_vocab, 1, n_rows),
                            g["ggml_new_tensor_3d"](ctx, _F32, n_vocab, n, n_rows))
    likelier = g["ggml_step"](ctx, g["ggml_sub"](ctx, wide, px))  # tokens likelier than each proposal
    above = g["ggml_reshape_2d"](ctx, g["ggml_sum_rows"](ctx, g["ggml_mul"](ctx, wide, likelier)), n, n_rows)
    count = g["ggml_reshape_2d"](ctx, g["ggml_sum_rows"](ctx, likelier), n, n_rows)
    def below(x: int, c: int) -> int:  # 1 where x < column c (x: n x n_rows)
        return g["ggml_step"](ctx, g["ggml_scale"](ctx, g["ggml_sub"](ctx, x, col(c)), -1.0))

    ok = g["ggml_mul"](ctx, below(above, 2), below(g["ggml_scale_bias"](ctx, count, 1.0, 0.5), 4))  # top-p, top-k
    best = g["ggml_argmax"](ctx, lg)  # I32 n_rows: the likeliest token, always kept
    pmax = g["ggml_get_rows"](ctx, g["ggml_reshape_3d"](ctx, p1, 1, n_vocab, n_rows),
                              g["ggml_reshape_2d"](ctx, best, 1, n_rows))  # 1 x 1 x n_rows
    floor = g["ggml_mul"](ctx, g["ggml_reshape_2d"](ctx, pmax, 1, n_rows), col(3))
    ok = g["ggml_mul"](ctx, ok, g["ggml_step"](ctx, g["ggml_sub"](ctx, g["ggml_reshape_2d"](ctx, px, n, n_rows), floor)))
    # the first accepted proposal: accepted, and none before it
    first = g["ggml_mul"](ctx, ok, g["ggml_step"](ctx, g["ggml_scale_bias"](ctx, g["ggml_cumsum"](ctx, ok), -1.0, 1.5)))
    chosen = g["ggml_sum_rows"](ctx, g["ggml_mul"](ctx, first, g["ggml_reshape_2d"](ctx, x, n, n_rows)))  # 1 x n_rows
    none = g["ggml_scale_bias"](ctx, g["ggml_sum_rows"](ctx, first), -1.0, 1.0)  # 1 where every proposal failed
    fallback = g["ggml_mul"](ctx, none, g["ggml_reshape_2d"](ctx, g["ggml_cast"](ctx, best, _F32), 1, n_rows))
    return g["ggml_reshape_1d"](ctx, g["ggml_cast"](ctx, g["ggml_add"](ctx, chosen, fallback), _I32), n_rows)
