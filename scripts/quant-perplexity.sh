#!/usr/bin/env bash
# How much quantizing a trained model's weights costs in perplexity, on text
# the model never saw. Trains a small Llama (examples/configs/text.toml) on
# this repository's own Rust and Markdown files, holding out the serving
# crate and its guide, then scores the held-out text with f32, int8, int4
# and W8A8 weights. Prints one JSON line per format (the last lines).
#
#   scripts/quant-perplexity.sh            # runs/text-data, runs/text, runs/text-held-out.txt
#   STEPS=800 scripts/quant-perplexity.sh  # a longer training
#
# A second run reuses the tokenized data and resumes the training run.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p tessera-cli
tessera=target/release/tessera
mkdir -p runs
held_out=runs/text-held-out.txt

# Held out: the serving crate and docs/serving.md; trained on the rest.
git ls-files '*.rs' '*.md' | grep -v -e '^runtime/serve/' -e '^docs/serving.md$' > runs/text-train-files.txt
git ls-files 'runtime/serve/src/*.rs' docs/serving.md | xargs cat > "$held_out"
if [ ! -f runs/text-data/index.json ]; then
    # One directory of the training files, so that prepare reads exactly them.
    rm -rf runs/text-train && mkdir -p runs/text-train
    while read -r f; do
        mkdir -p "runs/text-train/$(dirname "$f")" && cp "$f" "runs/text-train/$f"
    done < runs/text-train-files.txt
    rm -rf runs/text-data
    "$tessera" prepare --input runs/text-train --out runs/text-data --train-bpe 4096
fi
"$tessera" train --config examples/configs/text.toml ${STEPS:+--set run.steps=$STEPS}
echo "held-out text: $(wc -c < "$held_out") bytes of runtime/serve/src and docs/serving.md at $(git rev-parse --short HEAD)"
for format in "" int8 int4 w8a8; do
    "$tessera" perplexity --model runs/text --tokenizer runs/text-data --text "$held_out" --json ${format:+--quantize $format}
done
