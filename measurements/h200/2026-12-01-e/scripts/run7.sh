export EXACTNESS_GIT_SHA=$(cat .before/sha) EXACTNESS_GIT_DIRTY=0
start=$(date +%s)
timeout ${LIMIT:-580} make receipts PROFILE=gpu PY=python3 WHEELS=.whl OUT=$OUT/receipt 2>&1 | tr '\r' '\n' > /tmp/raw.log
echo "exit ${PIPESTATUS[0]} after $(( $(date +%s) - start )) s" >> /tmp/raw.log
L=$OUT/receipt.log
grep -v "^hash matrix\|^contract:\|^fp64:\|^streams:\|^bench" /tmp/raw.log > $L
for b in "hash matrix" contract fp64 streams bench; do grep "^$b" /tmp/raw.log | tail -1 >> $L; done
cd $OUT && tar czf receipt.tgz receipt .receipt* 2>/dev/null; rm -rf $OUT/receipt; ls -la $OUT
tail -40 $L
