"""Feature-interaction matrix: polytrain against a plain-PyTorch reference, factor by factor.

    strategy {single, ddp, fsdp, tensor, pipeline} x precision {32, 16-mixed, bf16-mixed}
    x accumulation {1, 3} x optimizers {1, 2} x dropout {off, on} x DataLoader workers {0, 2}
    x resume point {none, fit-end, step-checkpoint} x clipping {off, norm}
    x SGD implementation {for-loop, foreach, fused} x validation schedule {none, mid-epoch}

``pytest tests/matrix`` (part of ``make test``) runs an all-pairs covering set (``cases.py``); the table of
cases with the measured weight differences ends the output. The whole product (valid cases only):

    python -m tests.matrix --full          # or: pytest tests/matrix --matrix-full

See README.md here for the tolerance classes, the invalid combinations and the planted-bug record.
"""
