"""Renderers of the results pages under docs/results/: each turns result files from
benchmarks/results/ into Markdown lines (``benchmarks/summarize.py`` holds the manifest)."""
