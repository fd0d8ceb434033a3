"""Draw keys: a seeded request's randomness, keyed by the position of the token drawn.

Concept: a seeded request's token at output position p is drawn with noise that depends
only on ``(seed, p)``: the sampler seeds a generator with ``draw_key(seed, p)`` for that
row and draws its row of noise from it. Nothing about the draw depends on how many draws
came before, so the tokens of a seeded request do not depend on the batch around it, on
how its prompt was chunked, on preemption, or on how many drafts a step verified for it.

Mirrors: nothing in vLLM, which keeps one ``torch.Generator`` per request and advances it
with every draw (``InputBatch.generators``); tinyvllm did the same until that made a
request's stream depend on its drafts (NOTE 1).

Invariants: ``draw_key`` is a pure function of its two arguments, defined for every seed
``SamplingParams`` accepts (int64, negative included) and every position >= 0, and returns
a value ``torch.Generator.manual_seed`` takes (``0 .. 2**64 - 1``).

NOTE 1 (why not one generator a request): with a stream that advances, the n-th draw of a
request uses whatever the stream holds after n - 1 draws. Under speculative decoding a
verification step draws for each of its rows, and the number of rows a request gets in a
step depends on the token budget, so the rest of its stream depended on what else ran.
A partial prefill also drew and had to put the stream back. Keyed draws need neither.
NOTE 2 (the mixing): ``splitmix64``'s finaliser, applied to the position and then to the
seed combined with it, spreads neighbouring seeds and positions over all 64 bits, so no two
positions of one request, and no two children ``seed + i`` of a request with ``n > 1``,
share noise in any way a test can see. A CPU generator (Mersenne Twister) and a CUDA one
(Philox) still give different numbers for one key: a seed makes a request reproducible on
one device type, not across them (``sample/sampler.py`` NOTE 2).
"""

from __future__ import annotations

_MASK64 = (1 << 64) - 1


def _splitmix64(x: int) -> int:
    """One step of splitmix64's finaliser on a 64-bit value (NOTE 2)."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


# --8<-- [start:draw_key]
def draw_key(seed: int, position: int) -> int:
    """The generator seed for the draw of output token ``position`` of a request seeded with
    ``seed``: in ``0 .. 2**64 - 1``, a pure function of the two (module header)."""
    if position < 0:
        raise ValueError(f"position must be >= 0, got {position}")
    return _splitmix64((seed & _MASK64) ^ _splitmix64(position))
# --8<-- [end:draw_key]
