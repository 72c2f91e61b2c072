"""Train a small Llama-style decoder in Flax with jaxnorm's norms, then decode.

Pre-norm blocks with RMSNorm; each residual add and the norm after it are one
kernel (`jaxnorm.linen.AddRMSNorm`). The same model with Flax's own norms
(`--norms flax`: ``h = x + h; nn.RMSNorm()(h)``) has the same parameter tree,
so either loads the other's checkpoints. The task is synthetic (each token
follows from the one before), so the loss falls within a few dozen steps:

    python examples/llama_train.py                # jaxnorm norms, CPU or GPU
    python examples/llama_train.py --norms flax
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax

import jaxnorm.linen


@dataclasses.dataclass(frozen=True)
class Config:
    vocab: int = 256
    hidden: int = 128
    heads: int = 4
    ffn: int = 344
    layers: int = 2
    max_len: int = 64
    norms: str = "jaxnorm"  # or "flax"
    fuse_add: bool = True  # jaxnorm: the residual add in the norm's kernel
    dtype: jnp.dtype = jnp.bfloat16  # activations; parameters stay float32


def add_norm(cfg: Config, name: str, x, h):
    """h = x + h; y = RMSNorm(h): one kernel with jaxnorm, two ops with Flax."""
    if cfg.norms == "jaxnorm" and cfg.fuse_add:
        return jaxnorm.linen.AddRMSNorm(dtype=cfg.dtype, name=name)(x, h)
    h = x + h
    return norm(cfg, name, h), h


def norm(cfg: Config, name: str, h):
    cls = jaxnorm.linen.RMSNorm if cfg.norms == "jaxnorm" else nn.RMSNorm
    return cls(dtype=cfg.dtype, name=name)(h)


class Attention(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x, cache=None, pos=None):
        """x: (batch, seq, hidden). With a KV cache ((batch, max_len, heads,
        head_dim) each) x holds the tokens at `pos` onward; returns the new cache."""
        cfg = self.cfg
        hd = cfg.hidden // cfg.heads
        dense = dict(features=(cfg.heads, hd), use_bias=False, dtype=cfg.dtype)
        q = nn.DenseGeneral(**dense, name="q")(x)
        k = nn.DenseGeneral(**dense, name="k")(x)
        v = nn.DenseGeneral(**dense, name="v")(x)
        q_pos = jnp.arange(x.shape[1]) + (0 if pos is None else pos)
        if cache is not None:
            k = jax.lax.dynamic_update_slice_in_dim(cache[0], k.astype(cache[0].dtype), pos, 1)
            v = jax.lax.dynamic_update_slice_in_dim(cache[1], v.astype(cache[1].dtype), pos, 1)
            cache = (k, v)
        mask = q_pos[:, None] >= jnp.arange(k.shape[1])[None, :]
        logits = jnp.einsum("bqhd,bkhd->bhqk", q, k) / np.sqrt(hd)
        logits = jnp.where(mask, logits.astype(jnp.float32), -1e9)
        probs = jax.nn.softmax(logits, axis=-1).astype(cfg.dtype)
        out = jnp.einsum("bhqk,bkhd->bqhd", probs, v)
        out = nn.DenseGeneral(cfg.hidden, axis=(-2, -1), use_bias=False, dtype=cfg.dtype,
                              name="o")(out)
        return out, cache


class MLP(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, x):
        cfg = self.cfg
        gate = nn.Dense(cfg.ffn, use_bias=False, dtype=cfg.dtype, name="gate")(x)
        up = nn.Dense(cfg.ffn, use_bias=False, dtype=cfg.dtype, name="up")(x)
        return nn.Dense(cfg.hidden, use_bias=False, dtype=cfg.dtype, name="down")(
            nn.silu(gate) * up)


class Llama(nn.Module):
    cfg: Config

    @nn.compact
    def __call__(self, tokens, caches=None, pos=None):
        """tokens: (batch, seq) -> logits (batch, seq, vocab) and the caches."""
        cfg = self.cfg
        h = nn.Embed(cfg.vocab, cfg.hidden, dtype=cfg.dtype, name="embed")(tokens)
        start = 0 if pos is None else pos
        positions = jnp.arange(tokens.shape[1]) + start
        h = h + nn.Embed(cfg.max_len, cfg.hidden, dtype=cfg.dtype, name="pos")(positions)
        y = norm(cfg, "attn_norm_0", h)
        new_caches = []
        for i in range(cfg.layers):
            a, c = Attention(cfg, name=f"attn_{i}")(y, None if caches is None else caches[i], pos)
            new_caches.append(c)
            y, h = add_norm(cfg, f"mlp_norm_{i}", a, h)
            m = MLP(cfg, name=f"mlp_{i}")(y)
            last = i == cfg.layers - 1
            y, h = add_norm(cfg, "final_norm" if last else f"attn_norm_{i + 1}", m, h)
        logits = nn.Dense(cfg.vocab, use_bias=False, dtype=cfg.dtype, name="head")(y)
        return logits.astype(jnp.float32), new_caches


def batch_of(key, cfg: Config, batch: int, seq: int):
    """Sequences where token t+1 = (5 t + 3) mod vocab, from random starts."""
    toks = jax.random.randint(key, (batch, 1), 0, cfg.vocab)
    out = [toks]
    for _ in range(seq - 1):
        toks = (5 * toks + 3) % cfg.vocab
        out.append(toks)
    return jnp.concatenate(out, axis=1)


def make_train_step(model: Llama, tx):
    def loss_fn(params, tokens):
        logits, _ = model.apply(params, tokens[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    @jax.jit
    def train_step(params, opt_state, tokens):
        loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
        updates, opt_state = tx.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return train_step


def empty_caches(cfg: Config, batch: int):
    shape = (batch, cfg.max_len, cfg.heads, cfg.hidden // cfg.heads)
    return [(jnp.zeros(shape, cfg.dtype), jnp.zeros(shape, cfg.dtype))
            for _ in range(cfg.layers)]


def make_decode_step(model: Llama):
    """One token per sequence at position `pos`, against the KV caches."""

    @jax.jit
    def decode_step(params, tokens, caches, pos):
        logits, caches = model.apply(params, tokens, caches, pos)
        return jnp.argmax(logits[:, -1], axis=-1)[:, None], caches

    return decode_step


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--norms", choices=["jaxnorm", "flax"], default="jaxnorm")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--batch", type=int, default=16)
    args = ap.parse_args()
    cfg = Config(norms=args.norms)
    model = Llama(cfg)
    seq = 32
    params = model.init(jax.random.key(0), jnp.zeros((1, seq), jnp.int32))
    tx = optax.adamw(3e-3)
    opt_state = tx.init(params)
    train_step = make_train_step(model, tx)
    key = jax.random.key(1)
    t0 = time.perf_counter()
    for step in range(args.steps):
        key, sub = jax.random.split(key)
        params, opt_state, loss = train_step(params, opt_state, batch_of(sub, cfg, args.batch, seq))
        if step % 10 == 0 or step == args.steps - 1:
            print(f"step {step:3d}  loss {float(loss):.3f}")
    print(f"{args.steps} steps in {time.perf_counter() - t0:.1f} s on {jax.devices()[0].platform}")

    # Greedy decoding with the KV cache, from a prompt of one token.
    decode_step = make_decode_step(model)
    caches = empty_caches(cfg, 2)
    tok = jnp.array([[7], [100]], jnp.int32)
    generated = [tok]
    for pos in range(12):
        tok, caches = decode_step(params, tok, caches, pos)
        generated.append(tok)
    seqs = np.asarray(jnp.concatenate(generated, axis=1))
    follows = np.mean((5 * seqs[:, :-1] + 3) % cfg.vocab == seqs[:, 1:])
    print("decoded:", seqs[0].tolist(), f"({follows:.0%} of steps follow the rule)")


if __name__ == "__main__":
    main()
