"""Parallel strategies applied by ``train.prepare()``; the core registers ``ddp``."""
