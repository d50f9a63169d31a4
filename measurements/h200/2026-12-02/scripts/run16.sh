export PYTHONPATH=$PWD/lib PYTHONUNBUFFERED=1; timeout 200 python3 .before/attn_fold.py 2>&1 | tail -30
