#!/usr/bin/env bash
# A/B timing of the SSD tier's put and get through its public API, for two checkouts of
# the store crate (e.g. main and a branch), run alternately on the same disk.
#
#   bash scripts/bench/ssd_ab.sh OLD_REPO NEW_REPO [DIR] [ROUNDS] [BLOCKS]
#
# Each round: BLOCKS blocks of 2 MiB (two 1 MiB f32 planes) are put (fsync'd, as serving
# does) into a fresh store under DIR, then read back and verified three times (best of
# three, from the page cache). Prints every round, then medians and NEW/OLD time ratios.
set -euo pipefail
old=$(cd "$1" && pwd); new=$(cd "$2" && pwd)
dir=${3:-/var/tmp}; rounds=${4:-11}; blocks=${5:-64}
work=$(mktemp -d); trap 'rm -rf "$work"' EXIT
mkdir -p "$work/src"
cat > "$work/src/main.rs" <<'RS'
use std::time::Instant;
use store::{BlockMeta, Dtype, NamespaceDescription, Plane, PlaneSpec, ReadOutcome, SsdOptions, SsdTier};
fn main() {
    let dir = std::env::args().nth(1).expect("dir");
    let n: usize = std::env::args().nth(2).and_then(|s| s.parse().ok()).unwrap_or(64);
    let rows: u64 = 32768;
    let mut d = NamespaceDescription::new("bench", Dtype::F32, 4);
    d.layers = vec!["global".into()];
    d.planes = vec![PlaneSpec::new("l0.k", Dtype::F32, vec![rows, 8]), PlaneSpec::new("l0.v", Dtype::F32, vec![rows, 8])];
    let ns = d.id();
    let mut parent = ns.0;
    let mut blocks = Vec::new();
    for i in 0..n {
        let meta = BlockMeta::new(ns, parent, i as u32, (0..4).map(|j| (i * 4 + j) as u32).collect());
        parent = meta.key.0;
        let planes = d.planes.iter().enumerate().map(|(p, s)| {
            let data: Vec<u8> = (0..(rows * 32) as usize).map(|k| (k * 31 + i * 7 + p) as u8).collect();
            Plane::new(s.name.clone(), Dtype::F32, s.shape.clone(), data)
        }).collect();
        blocks.push(store::Block { meta, planes });
    }
    let root = std::path::Path::new(&dir).join(format!("ssd-ab-{}", std::process::id()));
    let t = SsdTier::open(&root, SsdOptions { read_only: false, budget: 1 << 40 }).unwrap();
    let s = Instant::now();
    for b in &blocks { t.put(b).unwrap(); }
    let put = s.elapsed().as_secs_f64();
    let mut get = f64::MAX;
    for _ in 0..3 {
        let s = Instant::now();
        for b in &blocks {
            match t.get(ns, b.meta.key) { ReadOutcome::Hit(_) => {} o => panic!("{o:?}") }
        }
        get = get.min(s.elapsed().as_secs_f64());
    }
    drop(t);
    std::fs::remove_dir_all(&root).unwrap();
    println!("{put:.4} {get:.4}");
}
RS
build() {
  cat > "$work/Cargo.toml" <<TOML
[package]
name = "ssd-ab"
version = "0.1.0"
edition = "2021"
[dependencies]
store = { package = "kvstore-store", path = "$1/store" }
[workspace]
TOML
  CARGO_TARGET_DIR="$work/target" cargo build --release -q --manifest-path "$work/Cargo.toml"
  cp "$work/target/release/ssd-ab" "$2"
}
build "$old" "$work/old"; build "$new" "$work/new"
for i in $(seq "$rounds"); do
  echo "old $("$work/old" "$dir" "$blocks")"; echo "new $("$work/new" "$dir" "$blocks")"
done | tee "$work/rounds"
python3 - "$work/rounds" <<'PY'
import statistics, sys
r = {"old": ([], []), "new": ([], [])}
for line in open(sys.argv[1]):
    side, put, get = line.split()
    r[side][0].append(float(put)); r[side][1].append(float(get))
for i, what in enumerate(["put", "get"]):
    o, n = statistics.median(r["old"][i]), statistics.median(r["new"][i])
    print(f"{what}: old median {o:.3f} s, new median {n:.3f} s, new/old time {n / o:.2f}")
PY
