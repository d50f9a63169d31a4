"""Analyses: each module computes one receipt section (``run_section(params) -> dict``) and renders it
(``render_md(section) -> str``).

    contract   the byte checker over every registered (prompt kernel, decode kernel) pair, with its coverage
    fp64       FP64 per-class accumulation receipt: taps (taps.py), certified fp64 references (fp64_ref.py,
               fp64_cert.py), ULPs and correct rounding (ulp.py), synthetic input sets (fp64_synth.py), tables and
               plots (fp64_report.py)
    streams    drafted == plain (MTP head, ../mtp.py), resumed == fresh (prompt cache, ../prompt_cache.py) and
               concurrent == alone == serial (../streams.py), each configuration run twice
    bench      the serving bench: TTFT, prefill/decode tok/s and ITL, plain and drafted, cold-cache prefill
               at exact lengths, 1 and 2 streams, peak memory and the expert ring (tables in bench_tables.py)
"""
