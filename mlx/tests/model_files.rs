//! Model files are opened read-only and checked before MLX parses them (issue 21).

use std::path::Path;
use std::process::Command;

/// A valid GGUF v3 file: `w` (F32, 32 x 2, values 0..64) and `q` (Q8_0, 32 values).
fn tiny_gguf() -> Vec<u8> {
    let mut b = b"GGUF".to_vec();
    b.extend(3u32.to_le_bytes());
    b.extend(2u64.to_le_bytes());
    b.extend(0u64.to_le_bytes());
    let mut tensor = |name: &str, dims: &[u64], t: u32, off: u64| {
        b.extend((name.len() as u64).to_le_bytes());
        b.extend(name.as_bytes());
        b.extend((dims.len() as u32).to_le_bytes());
        for d in dims {
            b.extend(d.to_le_bytes());
        }
        b.extend(t.to_le_bytes());
        b.extend(off.to_le_bytes());
    };
    tensor("w", &[32, 2], 0, 0);
    tensor("q.weight", &[32], 8, 256);
    while !b.len().is_multiple_of(32) {
        b.push(0);
    }
    for i in 0..64 {
        b.extend((i as f32).to_le_bytes());
    }
    // Q8_0 block: f16 scale 1.0 then 32 int8 values.
    b.extend(half::f16::from_f32(1.0).to_le_bytes());
    b.extend((0..32).map(|i| i as u8));
    b
}

/// Mounts a tmpfs at `dir` when this process may (root); `None` otherwise.
fn mount_tmpfs(dir: &Path) -> bool {
    std::fs::create_dir_all(dir).unwrap();
    Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=4m", "tmpfs"])
        .arg(dir)
        .status()
        .is_ok_and(|s| s.success())
}

#[test]
fn a_gguf_on_a_read_only_volume_loads() {
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().join("ro");
    let mounted = mount_tmpfs(&mnt);
    let path = mnt.join("tiny.gguf");
    std::fs::write(&path, tiny_gguf()).unwrap();
    if mounted {
        let ok = Command::new("mount")
            .args(["-o", "remount,ro"])
            .arg(&mnt)
            .status()
            .unwrap();
        assert!(ok.success());
    } else {
        // Root bypasses a file's mode, so only a read-only mount tests anything for root;
        // CI runs as root with mount rights.
        let root = Command::new("id")
            .arg("-u")
            .output()
            .is_ok_and(|o| o.stdout.starts_with(b"0\n"));
        assert!(
            !root,
            "running as root, but `mount -t tmpfs` failed: this test needs it (a 0444 file \
             would prove nothing for root)"
        );
        // Not root: a read-only file is the same test.
        eprintln!("not root: no tmpfs mount; testing a 0444 file instead");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o444)).unwrap();
    }
    let loaded = mlx::io::load_gguf(&path);
    if mounted {
        let _ = Command::new("umount").arg(&mnt).status();
    }
    let g = loaded.expect("a GGUF on a read-only volume must load");
    let w: Vec<f32> = g.tensors["w"].to_vec().unwrap();
    assert_eq!(w, (0..64).map(|i| i as f32).collect::<Vec<_>>());
    assert!(g.tensors.contains_key("q.scales"));
}

#[test]
fn fifos_and_devices_are_refused_before_they_are_opened() {
    let dir = tempfile::tempdir().unwrap();
    let fifo = dir.path().join("model.gguf");
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let err = mlx::io::load_gguf(&fifo).unwrap_err();
    assert!(err.to_string().contains("not a regular file"), "{err}");
    let link = dir.path().join("zero.safetensors");
    std::os::unix::fs::symlink("/dev/zero", &link).unwrap();
    let err = mlx::io::load_safetensors(&link).unwrap_err();
    assert!(err.to_string().contains("not a regular file"), "{err}");
}

/// The committed corpus and seeds of the `model_file` fuzz target, replayed on stable.
#[test]
fn model_file_corpus_replays() {
    let files = mlx::fuzzing::committed_inputs("model_file");
    assert!(files.len() >= 10, "no committed inputs for model_file");
    let scratch = tempfile::tempdir().unwrap();
    for path in files {
        let data = std::fs::read(&path).unwrap();
        let ok = std::panic::catch_unwind(|| {
            mlx::fuzzing::check_model_file(&data, &scratch.path().join("model"))
        });
        assert!(ok.is_ok(), "{} fails", path.display());
    }
}

#[test]
fn the_valid_seeds_load() {
    let seeds = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../fuzz/seeds/model_file");
    let g = mlx::io::load_gguf(&seeds.join("valid_tiny.gguf")).unwrap();
    assert!(
        g.tensors.contains_key("q41.biases"),
        "{:?}",
        g.tensors.keys()
    );
    let st = mlx::io::load_safetensors(&seeds.join("valid_tiny.safetensors")).unwrap();
    assert_eq!(st.tensors.len(), 3);
}
