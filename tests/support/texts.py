"""Small generated text files for the GPT tests (no network, no corpus)."""
import numpy as np


def text_file(folder, name="story.txt", n=6000, seed=0):
    """Words from a small vocabulary in a learnable order (each word mostly follows one
    other): a model that learned anything beats a uniform guess by far."""
    rng = np.random.default_rng(seed)
    words = ["the", "cat", "sat", "on", "a", "mat", "and", "dog", "ran", "to", "it", "\n"]
    out, i = [], 0
    while sum(map(len, out)) < n:
        i = (i + 1) % len(words) if rng.random() < 0.85 else int(rng.integers(len(words)))
        out.append(words[i] + ("" if words[i] == "\n" else " "))
    path = folder / name
    path.write_text("".join(out), encoding="utf-8")
    return path
