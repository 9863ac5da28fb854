#!/usr/bin/env python3
"""Fitting the synthetic models' drift parameters on a Gaussian simulation of their gate
(kairox synth's construction: per-neuron log-normal rates, token embeddings from a topic,
a domain and a token part; quiet layers, so a token's pre-activations are its embedding's),
before measuring the chosen ones on the real forward pass (bench/synth_stats.py).

Per configuration (JSON list on the command line) it prints the statistics bench/synth_stats.py
measures (kairox.stats definitions: density, hot fraction, adjacent-token and cross-prompt
distance) and the headroom of any cache policy at a capacity of 20% of the neurons: the GPU
share of a static top-20% (ranked on separate calibration prompts) and of an ideal online
cache that holds the top 20% by decayed count (half-life 16/64/256 tokens) with free reloads,
with the neurons it would move per token.

  python3 bench/drift_fit.py '[{"spread":1.2,"domains":4,"rho_d":0.35,"rho_t":0.05,"common":0.5}]'
"""
import math
import sys
from pathlib import Path

import numpy as np
from statistics import NormalDist
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))
from kairox.synth import firing_rates
from kairox.stats import hot_fraction, adjacent_jaccard, cross_prompt_jaccard, prompt_segments
inv = NormalDist().inv_cdf
def make(n_ff=2048, spread=1.6, mean=0.11, topics=32, rho_t=0.45, domains=0, rho_d=0.0, vocab=32000, seed=0):
    rng = np.random.default_rng(seed)
    rates = firing_rates(rng, n_ff, mean, spread)
    z = np.array([inv(1-p) for p in rates], np.float32)
    tt = rng.standard_normal((topics+1, n_ff), dtype=np.float32)
    D = max(domains, 1)
    dd = rng.standard_normal((D, n_ff), dtype=np.float32)
    dom = np.arange(topics+1) % D
    per = vocab // (topics+1)
    rho_e = 1 - rho_t - (rho_d if domains else 0)
    def acts(toks, _domain):
        k = toks // per
        e = np.stack([np.random.default_rng([seed, int(t)]).standard_normal(n_ff, dtype=np.float32) for t in toks])
        pre = math.sqrt(rho_e)*e + math.sqrt(rho_t)*tt[k]
        if domains:
            pre += math.sqrt(rho_d)*np.where((k>0)[:,None], dd[(k-1) % D], e[:, ::-1])
        return pre > z
    return acts, per, dom, topics, D
def prompts_for(model, n, L=256, common=0.3, seed=1):
    acts, per, dom, topics, D = model
    rng = np.random.default_rng(seed)
    out=[]
    for p in range(n):
        if D > 1:
            d = rng.integers(0, D); k = d + 1 + D * rng.integers(1, topics // D)
            ck = d + 1
        else:
            k = rng.integers(1, topics+1); ck = 0; d = 0
        toks = np.where(rng.random(L) < common, ck*per + rng.integers(0, per, L), k*per + rng.integers(0, per, L))
        out.append((acts(toks, d), d, k))
    return out
def online(masks, C, half, init):
    # cache = top-C by decayed count, updated after each token; perfect reloads
    w = init.astype(np.float64).copy(); a = 0.5 ** (1/half)
    cap = 0; tot = 0
    cache = np.argsort(-w)[:C]
    inc = np.zeros(masks.shape[1], bool); inc[cache]=True
    moved = 0
    for t in range(masks.shape[0]):
        m = masks[t]
        cap += (m & inc).sum(); tot += m.sum()
        w = w*a + m
        new = np.zeros_like(inc); new[np.argpartition(-w, C)[:C]] = True
        moved += (new & ~inc).sum(); inc = new
    return cap/tot, moved/masks.shape[0]
def run(cap=0.2, common=0.3, **kw):
    model = make(**kw)
    n_ff = kw.get("n_ff", 2048); C = int(cap*n_ff)
    calib = prompts_for(model, 16, seed=11, common=common)
    prof = np.concatenate([m for m,_,_ in calib]).sum(0)
    evalp = prompts_for(model, 16, seed=1, common=common)
    M = np.concatenate([m for m,_,_ in evalp]); doc = np.repeat(np.arange(len(evalp)), 256)
    st = dict(dens=M.mean(), hot80=hot_fraction(M.sum(0)), adj=adjacent_jaccard(M, doc),
              cross=cross_prompt_jaccard(M, prompt_segments(doc), doc))
    top = np.zeros(n_ff, bool); top[np.argsort(-prof)[:C]] = True
    st["static"] = (M & top).sum()/M.sum()
    for h in (16, 64, 256):
        st[f"online{h}"], st[f"moved{h}"] = online(M, C, h, prof/ prof.max())
    return {k: round(float(v),3) for k,v in st.items()}
if __name__ == "__main__":
    import json
    configs = json.loads(sys.argv[1])
    for c in configs:
        print(c, run(**c), flush=True)
