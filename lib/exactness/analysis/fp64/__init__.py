"""The FP64 per-class receipt.

    section.py  the section (run_section)
    calls.py    fp64_of_calls: FP64 error per class of recorded calls (a dump set of any engine, ours included)
    ref.py      FP64 references and error bounds per class; cert.py: certification of the references
    synth.py    synthetic input sets; report.py: its tables, plots and markdown (render_md)
"""
