"""Secret randomness: a ChaCha20 key stream for the DP noise and for Poisson sampling.

Why not ``torch.Generator``: the CPU Mersenne Twister keeps 32 bits of a seed and CUDA's
Philox 64, so a released noisy gradient lets an attacker search the seed, regenerate the
noise and subtract it. Here every random bit comes from ChaCha20 (RFC 8439), a stream
cipher, keyed by 256 bits from ``os.urandom``: without the key the stream cannot be
reproduced or predicted from any amount of its output.

One key stream, two implementations that give the same bits (a test checks them against
each other and against RFC 8439's test vector):
- CPU: OpenSSL's ChaCha20 through the ``cryptography`` package (about 2.5 GB/s per core);
- other devices (CUDA): the block function in torch integer ops, run where the noise is
  needed; for the noise it is compiled together with the Gaussian transform into fused
  kernels over fixed-size chunks (one compilation), eager if compiling fails (same values).

Each call draws from a fresh 96-bit nonce: a 64-bit draw counter and a 32-bit stream
number (the shard index when model states are sharded, else 0), so no two draws of any
rank share a nonce, and the state is just ``(key, draws)``. That state reproduces every future draw: it is secret
material, and so is any checkpoint that holds it (the sampler's; the engine never saves its noise key).

Floating point: uniforms have 53 random bits (never 0); Box-Muller in float64. With
``secure=True`` each noise value is the sum of four independent N(0, std²) draws divided by 2
(Holohan & Braghin 2021, what Opacus' secure mode does), so the low-order bits of a released
float do not betray the single draw behind it (Mironov 2012's attack on floating-point noise).
"""
from __future__ import annotations

import hashlib
import math
import os
import warnings

import torch
import torch.distributed as dist

_MASK32 = 0xFFFFFFFF
_BLOCK_WORDS = 16
_MAX_BLOCKS = 2 ** 32  # RFC 8439's 32-bit block counter: 256 GiB of stream per nonce
_CHUNK_BLOCKS = 2 ** 20  # blocks per compiled noise chunk on a GPU (64 MiB of stream)
# Noise values per nonce on the CPU. The Box-Muller temporaries cost ~160 B per value (four
# 53-bit draws each when secure): 2**17 keeps a draw near 20 MiB at the same speed as larger
# chunks, where 2**23 made the noise, not the model, the peak of a small model's DP step.
_NOISE_CHUNK = 2 ** 17
_SIGMA = (0x61707865, 0x3320646E, 0x79622D32, 0x6B206574)  # "expand 32-byte k"


class InsecureSeedWarning(UserWarning):
    """A fixed seed makes the DP noise or the sampling reproducible by anyone who knows it."""


def key_from_insecure_seed(seed: int, purpose: str) -> bytes:
    """A key derived from a public seed, for reproducible tests only; warns every time.

    ``purpose`` separates the streams ("noise", "sampling"), so one seed never gives the
    noise and the sampler the same stream.
    """
    warnings.warn(
        f"insecure_seed={seed} makes the {purpose} reproducible by anyone who knows the seed: the "
        "privacy guarantee does not hold for the released model. Use it for tests only.",
        InsecureSeedWarning, stacklevel=3)
    return hashlib.sha256(f"longshield_fx/{purpose}/{int(seed)}".encode()).digest()


def broadcast_key(key: bytes | None = None) -> bytes:
    """``key``, or 32 fresh bytes from ``os.urandom``; under torch.distributed, rank 0's.

    Every rank must call it at the same point (it is a collective when the world is > 1).
    The key crosses the process group in the clear, like the gradients do.
    """
    key = os.urandom(32) if key is None else bytes(key)
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        device = f"cuda:{torch.cuda.current_device()}" if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor(list(key), dtype=torch.uint8, device=device)
        dist.broadcast(t, src=0)
        key = bytes(t.cpu().tolist())
    return key


class KeyStream:
    """ChaCha20 keyed by 256 secret bits; each ``uniform53`` call uses a fresh nonce.

    ``stream``: the nonce's upper 32 bits. Holders of one key with different stream numbers
    (the shards of a sharded model) draw independent values; equal numbers, equal values.
    """

    def __init__(self, key: bytes | None = None, stream: int = 0):
        self.key = os.urandom(32) if key is None else bytes(key)
        if len(self.key) != 32:
            raise ValueError(f"KeyStream: the key must be 32 bytes, got {len(self.key)}")
        if not 0 <= stream < 2 ** 32:
            raise ValueError(f"KeyStream: stream must be in [0, 2**32), got {stream}")
        self.stream = stream
        self.draws = 0

    def uniform53(self, n: int, device: torch.device | str = "cpu") -> torch.Tensor:
        """``n`` independent integers uniform in [0, 2**53) (int64) on ``device``.

        Each is the top 53 bits of a little-endian 64-bit word of the next nonce's stream.
        """
        blocks = -(-2 * n // _BLOCK_WORDS)
        if blocks > _MAX_BLOCKS:
            raise ValueError(f"KeyStream: {n} values exceed one nonce's 2**32 blocks; draw in parts")
        nonce = self.next_nonce()
        device = torch.device(device)
        if device.type == "cpu":
            u64 = _openssl_u64(self.key, nonce, n)
            return (u64 >> 11) & (2 ** 53 - 1)  # arithmetic shift, then drop the sign copies
        w = _torch_words(self.key, nonce, 2 * n, device).view(n, 2)
        return (w[:, 1] << 21) | (w[:, 0] >> 11)

    def next_nonce(self) -> bytes:
        """The 96-bit nonce of the next draw: the draw counter (64 bits, little-endian), then
        the stream number (32 bits); nonces never repeat."""
        self.draws += 1
        return (self.draws - 1).to_bytes(8, "little") + self.stream.to_bytes(4, "little")

    def state_dict(self) -> dict:
        """The key and the draw counter: SECRET (they reproduce every future draw)."""
        return {"key": self.key, "draws": self.draws}

    def load_state_dict(self, state: dict) -> None:
        self.key, self.draws = bytes(state["key"]), int(state["draws"])


class NoiseGenerator:
    """Gaussian noise from a ``KeyStream``, on ``device``.

    ``secure=True`` guards against floating-point attacks (four draws per value, see the
    module docstring) at four times the stream; ``secure=False`` draws one value per
    coordinate from the same secret stream.
    """

    def __init__(self, device: torch.device | str, *, secure: bool = True, key: bytes | None = None,
                 stream: int = 0):
        self.device = torch.device(device)
        self.secure = secure
        self.stream = KeyStream(key, stream)

    def add_noise(self, tensors: list[torch.Tensor], std: float) -> None:
        """Add independent N(0, std²) values to every element of ``tensors``, in place.

        The values come in chunks (a fresh nonce each) that run across tensor boundaries, so
        many small tensors cost no more stream than one large one, and the float64 working
        set stays near one chunk whatever the model size.
        """
        remaining = sum(t.numel() for t in tensors)
        chunk, used = None, 0
        for t in tensors:
            flat, filled = t.view(-1), 0
            while filled < flat.numel():
                if chunk is None or used == chunk.numel():
                    chunk, used = self._chunk(remaining), 0
                k = min(flat.numel() - filled, chunk.numel() - used)
                flat[filled:filled + k] += (chunk[used:used + k] * std).to(device=flat.device, dtype=flat.dtype)
                filled, used, remaining = filled + k, used + k, remaining - k

    def normal(self, numel: int, std: float) -> torch.Tensor:
        """``numel`` independent N(0, std²) values, float32, on this generator's device."""
        out = torch.zeros(numel, dtype=torch.float32, device=self.device)
        self.add_noise([out], std)
        return out

    def _chunk(self, wanted: int) -> torch.Tensor:
        """Up to ``_NOISE_CHUNK`` standard normal values (float64) from the next nonce.

        On a GPU always one full compiled chunk (fixed shapes: one compilation); on the CPU
        just what is wanted.
        """
        if self.device.type == "cpu":
            n = min(wanted, _NOISE_CHUNK)
            draws = (4 if self.secure else 1) * n
            return _gaussian(self.stream.uniform53(draws + draws % 2), self.secure)[:n]
        fixed = _fixed_words(self.stream.key, self.stream.next_nonce(), self.device)
        counters = torch.arange(_CHUNK_BLOCKS, dtype=torch.int64, device=self.device)
        return _compiled_gaussian_blocks()(fixed, counters, self.secure)


def _gaussian(u53: torch.Tensor, secure: bool) -> torch.Tensor:
    """Standard normals (float64) from 53-bit uniform integers by Box-Muller; four summed / 2
    per value when ``secure``."""
    z = torch.stack(_box_muller(*u53.view(-1, 2).unbind(1)), 1).view(-1)
    return _half_sum(*z.view(-1, 4).unbind(1)) if secure else z


def _gaussian_blocks(fixed: torch.Tensor, counters: torch.Tensor, secure: bool) -> torch.Tensor:
    """``_gaussian`` of the ChaCha20 blocks at ``counters`` (for one fused GPU kernel).

    Each block's values are formed from its own 16 words, one lane per block, never from the
    stream laid out flat: from the flat stream the compiler split the work into kernels that
    pass the words through memory: 0.70-0.83 ms per 2**20-block chunk on an H200, against
    0.37 ms this way (same values).
    """
    w = _chacha_words(fixed, counters)
    u53 = [(w[2 * k + 1] << 21) | (w[2 * k] >> 11) for k in range(8)]
    z = [zi for p in range(4) for zi in _box_muller(u53[2 * p], u53[2 * p + 1])]
    return torch.stack([_half_sum(*z[:4]), _half_sum(*z[4:])] if secure else z, 1).reshape(-1)


def _box_muller(u53_1: torch.Tensor, u53_2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two independent standard normals (float64) from two 53-bit uniform integers."""
    u1, u2 = ((u.to(torch.float64) + 0.5) * 2.0 ** -53 for u in (u53_1, u53_2))  # in (0, 1): log never sees 0
    r = torch.sqrt(-2.0 * torch.log(u1))
    angle = (2.0 * math.pi) * u2
    return r * torch.cos(angle), r * torch.sin(angle)


def _half_sum(z0: torch.Tensor, z1: torch.Tensor, z2: torch.Tensor, z3: torch.Tensor) -> torch.Tensor:
    return (z0 + z1 + z2 + z3) / 2.0


def _openssl_u64(key: bytes, nonce: bytes, n: int) -> torch.Tensor:
    """``n`` little-endian 64-bit stream words as int64 (OpenSSL's ChaCha20)."""
    from cryptography.hazmat.primitives.ciphers import Cipher, algorithms

    # cryptography's 16-byte nonce is RFC 8439's block counter (little-endian) then the nonce.
    encryptor = Cipher(algorithms.ChaCha20(key, bytes(4) + nonce), mode=None).encryptor()
    out = bytearray(8 * n)  # zeros, encrypted in place: the key stream itself
    encryptor.update_into(memoryview(out), out)
    return torch.frombuffer(out, dtype=torch.int64)


def _fixed_words(key: bytes, nonce: bytes, device: torch.device) -> torch.Tensor:
    """The 16-word ChaCha20 input block with counter 0."""
    key_words = [int.from_bytes(key[4 * i:4 * i + 4], "little") for i in range(8)]
    nonce_words = [int.from_bytes(nonce[4 * i:4 * i + 4], "little") for i in range(3)]
    return torch.tensor([*_SIGMA, *key_words, 0, *nonce_words], dtype=torch.int64, device=device)


def _torch_words(key: bytes, nonce: bytes, n: int, device: torch.device) -> torch.Tensor:
    """``n`` stream words (int64 in [0, 2**32)) computed with torch ops on ``device``."""
    counters = torch.arange(-(-n // _BLOCK_WORDS), dtype=torch.int64, device=device)
    return _chacha_blocks(_fixed_words(key, nonce, device), counters)[:n]


def _int32_bits(x: torch.Tensor) -> torch.Tensor:
    """int64 values in [0, 2**32) as the int32 values with the same 32 bits."""
    return (x - (((x >> 31) & 1) << 32)).to(torch.int32)


def _rotl(x: torch.Tensor, s: int) -> torch.Tensor:
    """Rotate int32 words left by ``s``; ``>>`` is arithmetic, so the mask keeps the low ``s`` bits."""
    return (x << s) | ((x >> (32 - s)) & ((1 << s) - 1))


def _quarter_round(x: list, a: int, b: int, c: int, d: int) -> None:
    x[a] = x[a] + x[b]  # int32 addition wraps modulo 2**32, as ChaCha20's does
    x[d] = _rotl(x[d] ^ x[a], 16)
    x[c] = x[c] + x[d]
    x[b] = _rotl(x[b] ^ x[c], 12)
    x[a] = x[a] + x[b]
    x[d] = _rotl(x[d] ^ x[a], 8)
    x[c] = x[c] + x[d]
    x[b] = _rotl(x[b] ^ x[c], 7)


def _chacha_blocks(fixed: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """ChaCha20 blocks for the given block counters, as (len(counters) * 16,) words (int64 in
    [0, 2**32))."""
    return torch.stack(_chacha_words(fixed, counters), 1).reshape(-1)


def _chacha_words(fixed: torch.Tensor, counters: torch.Tensor) -> list[torch.Tensor]:
    """The 16 words (int64 in [0, 2**32)) of the ChaCha20 block at each of ``counters``.

    Sixteen word tensors and elementwise ops only, so a compiler fuses it into one kernel. The
    rounds run on int32, whose two's-complement addition and shifts are ChaCha20's 32-bit
    arithmetic: a GPU has no 64-bit integer units, and int32 words drew llama3.2-1b's noise in
    0.503 s on an H200 against 0.635 s with int64 words.
    """
    fixed32 = _int32_bits(fixed)
    state = [fixed32[i].expand(counters.shape) for i in range(16)]
    state[12] = _int32_bits(counters)
    x = list(state)
    for _ in range(10):
        for a, b, c, d in ((0, 4, 8, 12), (1, 5, 9, 13), (2, 6, 10, 14), (3, 7, 11, 15),
                           (0, 5, 10, 15), (1, 6, 11, 12), (2, 7, 8, 13), (3, 4, 9, 14)):
            _quarter_round(x, a, b, c, d)
    return [(xi + si).to(torch.int64) & _MASK32 for xi, si in zip(x, state)]


_compiled = None


def _compiled_gaussian_blocks():
    """``_gaussian_blocks`` compiled into fused kernels; eager (same values, slower) if compiling fails."""
    global _compiled
    if _compiled is None:
        compiled = torch.compile(_gaussian_blocks, dynamic=False, fullgraph=True)

        def run(fixed, counters, secure):
            global _compiled
            try:
                return compiled(fixed, counters, secure)
            except Exception as e:  # e.g. no Triton: the eager kernels give the same values
                warnings.warn(f"torch.compile failed for the noise kernel ({type(e).__name__}: {e}); "
                              "drawing noise with eager torch ops (same values, slower)")
                _compiled = _gaussian_blocks
                return _gaussian_blocks(fixed, counters, secure)

        _compiled = run
    return _compiled
