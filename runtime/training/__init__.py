"""Training DFlash drafters: prompt corpora, target-regenerated data, batches, the loop.

``python -m runtime.train`` (runtime/train.py) is the entry point; DFLASH.md section 4
is the recipe these modules implement.
"""
