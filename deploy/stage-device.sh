#!/usr/bin/env bash
# MLX's CUDA build (and any files named) for the device tool's GPU machine in as few calls as fit.
#
#   [WHEELS="mlx-lm==0.32.2 ..."] bash deploy/stage-device.sh [FILE...]
#       FILE: e.g. the SmolLM2 GGUF, for benchmarks/streams.py; WHEELS: more packages, e.g. mlx-lm
#       for benchmarks/side_by_side.py (the machine has transformers, numpy, sentencepiece)
#
# ../shared/tools/device-mlx.sh prepare ships the wheels as they are (4 calls of 24 MB); here they are
# unpacked and compressed with xz instead (193 MB unpacked -> 76 MB), then split into parts that each
# fit one call beside the tracked tree (64 MiB a call in all): 2 calls for MLX alone, 4 with the GGUF.
# It prints the calls to make back to back (the machine goes cold 30 s after a call). On the machine
# the last part unpacks into /tmp/site (export PYTHONPATH=/tmp/site) and each FILE into /tmp/.
set -euo pipefail
top=$(git rev-parse --show-toplevel)
cd "$top"
# shellcheck disable=SC2086  # WHEELS is a list
if [ -n "${WHEELS:-}" ] || [ ! -f .devwheels/manifest ]; then
  bash ../shared/tools/device-mlx.sh prepare 24 ${WHEELS:-} > /dev/null
fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/whl" "$work/site" "$work/blob"
cat .devwheels/p*/chunk_* | tar xf - -C "$work/whl"
for w in "$work"/whl/*.whl; do python3 -m zipfile -e "$w" "$work/site"; done
tar cf - -C "$work/site" . | xz -9 -T0 > "$work/blob/site.tar.xz"
for f in "$@"; do cp "$f" "$work/blob/"; done
(cd "$work/blob" && tar cf ../all.tar .)
tree_bytes=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
room=$(( 64 * 1024 * 1024 - tree_bytes - 1024 * 1024 ))  # a MiB spare for untracked files
total=$(stat -c %s "$work/all.tar")
parts=$(( (total + room - 1) / room ))
rm -rf .devwheels/s[0-9]*
split -n "$parts" -d -a 2 "$work/all.tar" "$work/part_"
for i in $(seq 1 "$parts"); do
  d=.devwheels/s$i
  mkdir -p "$d"
  mv "$work/part_$(printf %02d $((i - 1)))" "$d/"
  cat > "$d/stage.sh" <<EOS
#!/usr/bin/env bash
set -e
here=\$(cd "\$(dirname "\$0")" && pwd)
mkdir -p /tmp/sstage && cp "\$here"/part_* /tmp/sstage/
echo "staged \$(ls /tmp/sstage | wc -l) of $parts parts"
if [ "\$(ls /tmp/sstage | wc -l)" = $parts ] && [ ! -d /tmp/site/mlx ]; then
  mkdir -p /tmp/site /tmp/sblob && cat /tmp/sstage/part_* | tar xf - -C /tmp/sblob
  xz -d -T0 < /tmp/sblob/site.tar.xz | tar xf - -C /tmp/site
  rm /tmp/sblob/site.tar.xz
  find /tmp/sblob -maxdepth 1 -type f -exec mv {} /tmp/ \;
  echo "installed into /tmp/site"
fi
EOS
  last=""
  [ "$i" = "$parts" ] && last=" && export PYTHONPATH=/tmp/site && YOUR COMMAND"
  echo "call $i: carry [\"$d\"]  command: bash $d/stage.sh$last"
done
