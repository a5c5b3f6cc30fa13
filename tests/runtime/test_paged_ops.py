"""The paged KV-pool operators (native/paged_ops.cpp) against their PyTorch oracle (runtime/paged_reference.py):
float and SimQuant-coded pools, steps mixing decode rows of several sequences with a prefill chunk, and the coded
pool's attention against plain attention over what it decodes."""

from __future__ import annotations

import shutil
from dataclasses import dataclass, field

import pytest
import torch

from llmeasyquant.nn.kv.key_blocks import KeyBlocks
from llmeasyquant.primitives import unpack_bits
from llmeasyquant.runtime import paged_reference as ref

if shutil.which("c++") is None and shutil.which("g++") is None:
    pytest.skip("no C++ compiler on this machine: the paged operators cannot be built (the engine runs "
                "runtime/paged_reference.py)", allow_module_level=True)


def rope_table(positions: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    inv_freq = 1.0 / 10000 ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = torch.arange(positions, dtype=torch.float32)[:, None] * inv_freq
    emb = torch.cat((angles, angles), dim=-1)
    return emb.cos(), emb.sin()


@dataclass
class Pool:
    """Sequences with block tables over a shuffled pool, and the positions each has stored."""

    block: int
    heads: int
    kv_heads: int
    dim: int
    sequences: int = 4
    max_blocks: int = 8
    seed: int = 0
    stored: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.gen = torch.Generator().manual_seed(self.seed)
        self.blocks = self.sequences * self.max_blocks + 3  # a few blocks no sequence owns
        order = torch.randperm(self.blocks, generator=self.gen)[: self.sequences * self.max_blocks]
        self.tables = order.reshape(self.sequences, self.max_blocks).to(torch.int32)
        self.stored = [0] * self.sequences
        self.cos_table, self.sin_table = rope_table(self.max_blocks * self.block, self.dim)

    def step(self, counts: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
        """Rows for (sequence, new positions) in order: row_seq, positions, slots, lengths, qkv, cos, sin."""
        row_seq, positions = [], []
        for seq, count in counts:
            row_seq += [seq] * count
            positions += list(range(self.stored[seq], self.stored[seq] + count))
            self.stored[seq] += count
        row_seq_t, positions_t = torch.tensor(row_seq), torch.tensor(positions)
        blocks = self.tables[row_seq_t, positions_t // self.block].long()
        rows = len(row_seq)
        width = (self.heads + 2 * self.kv_heads) * self.dim
        return {"row_seq": row_seq_t, "positions": positions_t, "slots": blocks * self.block + positions_t % self.block,
                "lengths": positions_t + 1, "qkv": torch.randn(rows, width, generator=self.gen) * 2,
                "cos": self.cos_table[positions_t], "sin": self.sin_table[positions_t]}

    def float_pools(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        # Random contents: a slot never written must never be read.
        shape = (self.blocks, self.kv_heads, self.block, self.dim)
        return (torch.randn(shape, generator=self.gen).to(dtype), torch.randn(shape, generator=self.gen).to(dtype))

    def quant_pool(self, bits: int, n_out: int, sinks: int) -> list[torch.Tensor]:
        width = self.dim if bits == 8 else -(-self.dim // 8) * bits
        n, h, b, d, s = self.blocks, self.kv_heads, self.block, self.dim, self.sequences

        def noise(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            if dtype == torch.uint8:
                return torch.randint(0, 256, shape, generator=self.gen, dtype=torch.uint8)
            return torch.randn(shape, generator=self.gen).to(dtype)

        return [noise(n, h, b, width, dtype=torch.uint8), noise(n, h, d, dtype=torch.half),
                noise(n, h, d, dtype=torch.half).abs(), noise(n, h, b, width, dtype=torch.uint8),
                noise(n, h, b, dtype=torch.half).abs(), noise(n, h, b, dtype=torch.uint8),
                noise(n, h, b, n_out, dtype=torch.half), torch.randint(0, d, (n, h, b, n_out), generator=self.gen,
                                                                        dtype=torch.uint8),
                noise(s, h, sinks, d, dtype=torch.half), noise(s, h, sinks, d, dtype=torch.half),
                noise(s, h, b, d, dtype=torch.half)]


def norms(dim: int, present: bool) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    if not present:
        return None, None
    gen = torch.Generator().manual_seed(7)
    return torch.rand(dim, generator=gen) + 0.5, torch.rand(dim, generator=gen) + 0.5


# Steps of (sequence, new positions): prefills, then decode rows of several sequences around a prefill chunk that
# runs over a block end (and, at 16 positions a block, over two), then decode rows; no length a multiple of B.
STEPS = [[(0, 37), (1, 21), (2, 5)],
         [(0, 1), (1, 1), (2, 40), (3, 3)],
         [(3, 1), (0, 1), (2, 1), (1, 1)]]
# heads, kv_heads, dim: 3 query heads a kv head; 24 values a head are no whole number of vectors (plain loops)
SHAPES = [(9, 3, 64), (6, 2, 16), (3, 1, 24)]


@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), SHAPES)
@pytest.mark.parametrize("with_norms", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_float_pool_matches_reference(ops, block, heads, kv_heads, dim, with_norms, dtype):
    pool = Pool(block, heads, kv_heads, dim, seed=block + dim)
    keys, values = pool.float_pools(dtype)
    ref_keys, ref_values = keys.clone(), values.clone()
    q_norm, k_norm = norms(dim, with_norms)
    tol = {"atol": 1e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-3, "rtol": 1e-3}
    for counts in STEPS:
        rows = pool.step(counts)
        args = (rows["qkv"], rows["cos"], rows["sin"])
        tail = (rows["slots"], heads, q_norm, k_norm, 1e-6, 1e-5)
        q = ops.paged_rope_store(*args, keys, values, *tail)
        expected_q = ref.paged_rope_store(*args, ref_keys, ref_values, *tail)
        torch.testing.assert_close(q, expected_q, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(keys.float(), ref_keys.float(), **tol)
        assert torch.equal(values, ref_values)
        attention = (pool.tables, rows["row_seq"], rows["lengths"], dim**-0.5)
        found = ops.paged_attention(q, keys, values, *attention)
        assert found.shape == (q.shape[0], heads * dim)
        torch.testing.assert_close(found, ref.paged_attention(q, keys, values, *attention), atol=1e-4, rtol=1e-4)


def assert_codes_match(found: torch.Tensor, expected: torch.Tensor, bits: int, dim: int) -> None:
    """Packed codes equal, but for at most a tiny share off by one (a value within rounding noise of a midpoint)."""
    diff = (unpack_bits(found, bits, dim).int() - unpack_bits(expected, bits, dim).int()).abs()
    assert int(diff.max()) <= 1
    assert float((diff > 0).float().mean()) <= 1e-3


def assert_quant_pools_match(found: list[torch.Tensor], expected: list[torch.Tensor], bits: int, dim: int) -> None:
    for i in (0, 3):
        assert_codes_match(found[i], expected[i], bits, dim)
    for i in (1, 2, 4, 5, 6, 7, 9, 10):
        assert torch.equal(found[i], expected[i]), ref.QUANT_POOL[i]
    torch.testing.assert_close(found[8].float(), expected[8].float(), atol=1e-3, rtol=1e-3)  # rotated: fp16 ulps


# (bits, outliers, sinks): sinks within block 0, none, and more than a block of 16.
CODINGS = [(4, 2, 4), (2, 0, 0), (3, 1, 20), (8, 2, 4)]


@pytest.mark.parametrize("block", [16, 32])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), SHAPES)
@pytest.mark.parametrize("with_norms", [False, True])
@pytest.mark.parametrize(("bits", "n_out", "sinks"), CODINGS)
def test_quant_pool_matches_reference(ops, block, heads, kv_heads, dim, with_norms, bits, n_out, sinks):
    pool = Pool(block, heads, kv_heads, dim, seed=bits + block)
    tensors = pool.quant_pool(bits, n_out, sinks)
    expected = [t.clone() for t in tensors]
    q_norm, k_norm = norms(dim, with_norms)
    for counts in STEPS:
        rows = pool.step(counts)
        args = (rows["qkv"], rows["cos"], rows["sin"])
        tail = (rows["slots"], rows["row_seq"], rows["positions"], heads, q_norm, k_norm, 1e-6, 1e-5, bits, sinks)
        q = ops.quant_rope_store(*args, tensors, *tail)
        torch.testing.assert_close(q, ref.quant_rope_store(*args, expected, *tail), atol=1e-5, rtol=1e-5)
        assert_quant_pools_match(tensors, expected, bits, dim)
        attention = (pool.tables, rows["row_seq"], rows["lengths"], pool.cos_table, pool.sin_table, bits, sinks,
                     dim**-0.5)
        found = ops.quant_attention(q, tensors, *attention)
        torch.testing.assert_close(found, ref.quant_attention(q, tensors, *attention), atol=1e-4, rtol=1e-4)


def filled_quant_pool(ops, bits: int, n_out: int, sinks: int, block: int = 16, steps=STEPS
                      ) -> tuple[Pool, list[torch.Tensor], dict[str, torch.Tensor], torch.Tensor]:
    """A quantized pool after `steps` stored by the operators: the pool, its tensors, the last step's rows and
    their rotated queries."""
    pool = Pool(block, 9, 3, 64, seed=3)
    tensors = pool.quant_pool(bits, n_out, sinks)
    for counts in steps:
        rows = pool.step(counts)
        q = ops.quant_rope_store(rows["qkv"], rows["cos"], rows["sin"], tensors, rows["slots"], rows["row_seq"],
                                 rows["positions"], 9, None, None, 0.0, 0.0, bits, sinks)
    return pool, tensors, rows, q


@pytest.mark.parametrize(("bits", "n_out", "sinks"), CODINGS)
def test_quant_attention_is_attention_over_what_gather_decodes(ops, bits, n_out, sinks):
    pool, tensors, rows, q = filled_quant_pool(ops, bits, n_out, sinks)
    found = ops.quant_attention(q, tensors, pool.tables, rows["row_seq"], rows["lengths"], pool.cos_table,
                                pool.sin_table, bits, sinks, 0.125)
    for seq in range(pool.sequences):
        length = pool.stored[seq]
        keys, values = ops.quant_gather(tensors, pool.tables[seq], seq, length, pool.cos_table, pool.sin_table, bits,
                                        sinks)
        expected_keys, expected_values = ref.quant_gather(tensors, pool.tables[seq], seq, length, pool.cos_table,
                                                          pool.sin_table, bits, sinks)
        torch.testing.assert_close(keys, expected_keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(values, expected_values, atol=1e-5, rtol=1e-5)
        for r in (rows["row_seq"] == seq).nonzero().flatten().tolist():
            attended = rows["lengths"][r]
            weights = torch.softmax(torch.einsum("hd,htd->ht", q[r], keys.repeat_interleave(3, 0)[:, :attended]) *
                                    0.125, dim=-1)
            plain = torch.einsum("ht,htd->hd", weights, values.repeat_interleave(3, 0)[:, :attended]).reshape(-1)
            torch.testing.assert_close(found[r], plain, atol=1e-4, rtol=1e-4)


def test_key_blocks_are_coded_as_key_blocks_codes_them(ops):
    """The pool's complete key blocks hold what KeyBlocks (online ranges) stores for the same pre-rotary keys."""
    sinks, block = 4, 16
    pool = Pool(block, 9, 3, 64, seed=5)
    tensors = pool.quant_pool(4, 0, sinks)
    rows = pool.step([(1, 70)])
    ops.quant_rope_store(rows["qkv"], rows["cos"], rows["sin"], tensors, rows["slots"], rows["row_seq"],
                         rows["positions"], 9, None, None, 0.0, 0.0, 4, sinks)
    keys = rows["qkv"][:, 9 * 64: 12 * 64].reshape(70, 3, 64).transpose(0, 1)[None, :, sinks:]  # [1, 3, 66, 64]
    blocks = KeyBlocks(4, block, sinks)
    blocks.append(keys.half().float())  # the pool codes blocks from its fp16 residual
    stored = blocks.stored.tensors
    table = pool.tables[1, : 70 // block].long()
    codes = torch.cat([tensors[0][table[0], :, sinks:]] + [tensors[0][b] for b in table[1:]], dim=1)
    assert torch.equal(codes, stored["codes"][0])
    assert torch.equal(tensors[1][table].transpose(0, 1), stored["range_lo"][0])
    assert torch.equal(tensors[2][table].transpose(0, 1), stored["range_scale"][0])


@pytest.mark.parametrize("threads", [1, 2])
def test_long_decode_rows_split_over_threads(ops, threads):
    """A few long sequences: one decode row each is split into pieces whose softmax states are merged."""
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        pool = Pool(16, 9, 3, 64, sequences=2, max_blocks=64, seed=11)
        keys, values = pool.float_pools(torch.float16)
        tensors = pool.quant_pool(4, 2, 4)
        for counts in ([(0, 700), (1, 1000)], [(1, 1), (0, 1)]):
            rows = pool.step(counts)
            args = (rows["qkv"], rows["cos"], rows["sin"])
            q = ops.paged_rope_store(*args, keys, values, rows["slots"], 9, None, None, 0.0, 0.0)
            ops.quant_rope_store(*args, tensors, rows["slots"], rows["row_seq"], rows["positions"], 9, None, None,
                                 0.0, 0.0, 4, 4)
        attention = (pool.tables, rows["row_seq"], rows["lengths"])
        torch.testing.assert_close(ops.paged_attention(q, keys, values, *attention, 0.125),
                                   ref.paged_attention(q, keys, values, *attention, 0.125), atol=1e-4, rtol=1e-4)
        quant = (*attention, pool.cos_table, pool.sin_table, 4, 4, 0.125)
        torch.testing.assert_close(ops.quant_attention(q, tensors, *quant), ref.quant_attention(q, tensors, *quant),
                                   atol=1e-4, rtol=1e-4)
    finally:
        torch.set_num_threads(old)


def test_four_bit_attention_stays_close_to_float_attention(ops):
    """Decode quality: 4-bit keys (per channel, per block) and values (per token, 2 outliers) on Gaussian keys and
    values against float attention over the same rotated keys and values."""
    pool = Pool(16, 9, 3, 64, sequences=1, max_blocks=32, seed=13)
    tensors = pool.quant_pool(4, 2, 4)
    keys, values = pool.float_pools(torch.float32)
    errors = []
    for counts in ([(0, 300)], [(0, 1)]):
        rows = pool.step(counts)
        args = (rows["qkv"], rows["cos"], rows["sin"])
        q = ops.paged_rope_store(*args, keys, values, rows["slots"], 9, None, None, 0.0, 0.0)
        ops.quant_rope_store(*args, tensors, rows["slots"], rows["row_seq"], rows["positions"], 9, None, None, 0.0,
                             0.0, 4, 4)
        attention = (pool.tables, rows["row_seq"], rows["lengths"])
        exact = ops.paged_attention(q, keys, values, *attention, 0.125)
        coded = ops.quant_attention(q, tensors, *attention, pool.cos_table, pool.sin_table, 4, 4, 0.125)
        errors.append(float((coded - exact).norm() / exact.norm()))
    assert max(errors) < 0.2, errors


def test_bad_inputs_are_refused(ops):
    pool = Pool(16, 9, 3, 64, seed=1)
    keys, values = pool.float_pools(torch.float32)
    rows = pool.step([(0, 3)])
    args = (rows["qkv"], rows["cos"], rows["sin"])
    with pytest.raises(RuntimeError, match="outside the pool"):
        ops.paged_rope_store(*args, keys, values, rows["slots"] + 10**6, 9, None, None, 0.0, 0.0)
    with pytest.raises(RuntimeError, match="must be Float or Half"):
        ops.paged_rope_store(*args, keys.double(), values.double(), rows["slots"], 9, None, None, 0.0, 0.0)
    q = ops.paged_rope_store(*args, keys, values, rows["slots"], 9, None, None, 0.0, 0.0)
    with pytest.raises(RuntimeError, match="do not group"):
        ops.paged_attention(q[:, :8], keys, values, pool.tables, rows["row_seq"], rows["lengths"], 1.0)
    with pytest.raises(RuntimeError, match=r"outside 1\.\."):
        ops.paged_attention(q, keys, values, pool.tables, rows["row_seq"], rows["lengths"] * 1000, 1.0)
    tables = pool.tables.clone()
    tables[0, 0] = pool.blocks
    with pytest.raises(RuntimeError, match="is pool block"):
        ops.paged_attention(q, keys, values, tables, rows["row_seq"], rows["lengths"], 1.0)
    tensors = pool.quant_pool(4, 2, 4)
    with pytest.raises(RuntimeError, match="list of 11 tensors"):
        ops.quant_attention(q, tensors[:10], pool.tables, rows["row_seq"], rows["lengths"], pool.cos_table,
                            pool.sin_table, 4, 4, 1.0)
    with pytest.raises(RuntimeError, match="bytes a vector"):
        ops.quant_attention(q, tensors, pool.tables, rows["row_seq"], rows["lengths"], pool.cos_table,
                            pool.sin_table, 2, 4, 1.0)
    with pytest.raises(RuntimeError, match="not at offset"):
        ops.quant_rope_store(*args, tensors, rows["slots"] + 1, rows["row_seq"], rows["positions"], 9, None, None,
                             0.0, 0.0, 4, 4)
