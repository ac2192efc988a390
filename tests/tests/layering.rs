//! The crate map of docs/design.md holds: each runtime crate depends on
//! exactly the Tessera crates its layer may import, so an arrow pointing up
//! (or a shortcut the map does not draw) fails here before it spreads.

use std::collections::BTreeSet;
use std::path::Path;

/// Each runtime crate's directory and the Tessera crates it may import.
const MAP: &[(&str, &[&str])] = &[
    ("kernels", &[]),
    ("runtime/core", &["tessera-kernels"]),
    ("runtime/dist", &["tessera-core", "tessera-kernels"]),
    ("runtime/nn", &["tessera-core", "tessera-dist"]),
    ("runtime/optim", &["tessera-core", "tessera-nn"]),
    ("runtime/parallel", &["tessera-core", "tessera-dist", "tessera-nn", "tessera-optim"]),
    ("runtime/data", &["tessera-core"]),
    ("runtime/observe", &["tessera-core"]),
    ("runtime/train", &["tessera-core", "tessera-dist", "tessera-nn", "tessera-optim", "tessera-parallel", "tessera-data", "tessera-observe", "tessera-plan"]),
    ("runtime/testing", &["tessera-core", "tessera-dist", "tessera-nn", "tessera-parallel"]),
    ("runtime/serve", &["tessera-core", "tessera-dist", "tessera-nn", "tessera-data"]),
    ("runtime/server", &["tessera-core", "tessera-serve", "tessera-data"]),
    ("runtime/plan", &["tessera-core", "tessera-dist", "tessera-nn", "tessera-parallel"]),
    ("macros", &[]),
];

/// The Tessera crates named in `[dependencies]` of a manifest, with any
/// target-specific dependency tables.
fn tessera_dependencies(manifest: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let mut in_deps = false;
    for line in manifest.lines().map(str::trim) {
        if line.starts_with('[') {
            in_deps = line == "[dependencies]" || (line.starts_with("[target.") && line.ends_with(".dependencies]"));
            continue;
        }
        if !in_deps {
            continue;
        }
        let name = line.split(['=', '.', ' ']).next().unwrap_or("");
        if name.starts_with("tessera") {
            out.insert(name.to_string());
        }
    }
    out
}

#[test]
fn every_runtime_crate_imports_only_the_layers_below_it() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace root");
    for (dir, allowed) in MAP {
        let path = root.join(dir).join("Cargo.toml");
        let manifest = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let have = tessera_dependencies(&manifest);
        let allowed: BTreeSet<String> = allowed.iter().map(|s| s.to_string()).collect();
        let extra: Vec<_> = have.difference(&allowed).collect();
        assert!(extra.is_empty(), "{dir} depends on {extra:?}, which its layer may not import (docs/design.md, \"The crate map\")");
    }
}

#[test]
fn the_map_covers_every_runtime_crate() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace root");
    let mapped: BTreeSet<&str> = MAP.iter().map(|(d, _)| *d).collect();
    for entry in std::fs::read_dir(root.join("runtime")).expect("runtime/") {
        let entry = entry.expect("a directory entry");
        let dir = format!("runtime/{}", entry.file_name().to_string_lossy());
        if dir == "runtime/tessera" || !entry.path().join("Cargo.toml").exists() {
            continue; // the facade imports everything
        }
        assert!(mapped.contains(dir.as_str()), "{dir} is a runtime crate the layering map does not know; add it to MAP and to docs/design.md");
    }
}

#[test]
fn the_parser_sees_dependencies_in_every_form() {
    let manifest = "[package]\nname = \"x\"\n[dependencies]\ntessera-core.workspace = true\ntessera-nn = { path = \"../nn\" }\nserde.workspace = true\n[dev-dependencies]\ntessera.workspace = true\n[target.'cfg(unix)'.dependencies]\ntessera-dist.workspace = true\n";
    let got: Vec<String> = tessera_dependencies(manifest).into_iter().collect();
    assert_eq!(got, ["tessera-core", "tessera-dist", "tessera-nn"]);
}
