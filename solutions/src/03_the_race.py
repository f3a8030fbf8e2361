# %% [markdown]
# # Exercises · 03 The race
#
# Two small functions: the metadata that travels host→GPU every decode step, and a verdict on a
# timeline. Write each one where it says `YOUR CODE HERE`, then run the check cell below it.
# Everything here runs on the CPU.

# %%
import matplotlib.pyplot as plt

from pinlab.checks import l03 as checks03
from pinlab import steploop
from pinlab.plots import timeline

# %% [markdown]
# ## 1. indptr and last_page_len
#
# A paged KV cache keeps each request's tokens in pages of `page_size` tokens. FlashInfer finds a
# request's pages through two arrays that vLLM computes on the host every step:
# - `indptr` (B+1 ints): 0, then the running sum of the pages each request uses
#   (`ceil(seq_len / page_size)`);
# - `last_page_len` (B ints): the tokens in each request's last page: `page_size` when that page
#   is full, and 0 for an empty request.
#
# Example with `page_size=16`: `seq_lens [37, 48, 17, 0]` give `indptr [0, 3, 6, 8, 8]` and
# `last_page_len [5, 16, 1, 0]`.
#
# Write `indptr_last_page_len(seq_lens, page_size)` returning `(indptr, last_page_len)` as two
# lists of ints. *(5-8 lines)*

# %%
def indptr_last_page_len(seq_lens, page_size):
    ### BEGIN SOLUTION
    indptr, last = [0], []
    for n in seq_lens:
        pages = -(-n // page_size)
        indptr.append(indptr[-1] + pages)
        r = n % page_size
        last.append(page_size if (r == 0 and n > 0) else r)
    return indptr, last
    ### END SOLUTION


ok = checks03.check_indptr_last_page_len(indptr_last_page_len)

# %% [markdown]
# ## 2. Did each copy read its own step?
#
# One reused pinned buffer. `writes[n] = (start, end)` is when the host wrote step n's data into
# it; `copies[n] = (start, end)` is when the GPU's DMA for step n ran (it reads the buffer while it
# runs). Copy n delivered step n's data only if **no later step's write starts before copy n
# ends** (a write starting exactly at its end is fine).
#
# Here is a timeline from the model of lesson 03, the host two steps ahead of the GPU:

# %%
sim = steploop.simulate("reused_pinned", steps=6, ahead=2)
timeline({"host": sim["host"], "GPU": sim["gpu"]}, title="One reused pinned buffer, host two steps ahead (model)")
plt.show()
print("writes:", sim["writes"])
print("copies:", sim["copies"])

# %% [markdown]
# Write `copies_correct(writes, copies)` returning a list of booleans, one per step: True where
# copy n delivered step n's data. *(2-4 lines)*

# %%
def copies_correct(writes, copies):
    ### BEGIN SOLUTION
    return [all(writes[m][0] >= copies[n][1] for m in range(n + 1, len(writes))) for n in range(len(copies))]
    ### END SOLUTION


ok = checks03.check_copies_correct(copies_correct)

# %% [markdown]
# Compare with what the model says each copy delivered (-1 would mean a write was in progress):

# %%
try:
    print("your verdict:       ", copies_correct(sim["writes"], sim["copies"]))
except NotImplementedError:
    print("write copies_correct above first")
print("step each copy read:", sim["received"])
