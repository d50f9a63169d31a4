"""Analyses: each computes one receipt section (``run_section(params) -> dict``) and describes its view once as
display blocks (``blocks(section)``, ../blocks.py) that its notebook shows and ``render_md(section) -> str`` writes
for receipt.md, in its views module; the section table (receipt/sections.py) names both.

    hashes     the hash matrix, one row per engine x configuration x prompt: our engine's every prompt x path x
               step x kernel set against its serial-decode oracle, with a step sweep at tile boundaries and an fp32
               control (hashes_report.py: tables and view), or the engines under test (engines.py: below)
    contract/  the byte checker over every registered (prompt kernel, decode kernel) pair at every call site
               (check.py: the section; cases.py, inputs.py: what is fed; report.py: tables and plots)
    fp64/      FP64 per-class accumulation receipt: certified fp64 references (ref.py, cert.py), synthetic input
               sets (synth.py), the section (section.py), tables and plots (report.py); taps.py records kernel
               calls, ulp.py counts ULPs and checks correct rounding
    streams    drafted == plain (../mtp.py), resumed == fresh (../prompt_cache.py) and concurrent == alone ==
               serial (../batch.py), on tokens, logit bytes and KV bytes (streams_report.py: tables)
    bench      the serving bench: TTFT, prefill/decode tok/s and ITL, plain and drafted, cold-cache prefill at
               exact lengths, 1 and 2 streams, peak memory and the expert ring (bench_tables.py: tables)
    engines    the hash matrix of engines under test (../engines/) against each engine's oracle, stream
               equalities, bench (engines_bench.py), a cross-engine view (engines_md.py: tables and view)
"""
