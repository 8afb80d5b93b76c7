"""The demo model's recipe (`python -m shared.demo.train`, what `make demo-model` runs) and the offline
demo (`python -m shared.demo.offline`): tools on top of the engine, not part of the serving path."""
