//! Binaries of the workspace find libmlx through their rpath, without `LD_LIBRARY_PATH`.

use std::process::Command;

use kvstore_tests::kvstore_bin;

#[test]
fn this_test_binary_runs_mlx_without_ld_library_path() {
    assert!(
        std::env::var("LD_LIBRARY_PATH").map_or(true, |p| !p.contains(".mlx")),
        "the test was started with libmlx on LD_LIBRARY_PATH, which would hide a missing rpath"
    );
    let a = mlx::Array::from_slice(&[1.0f32, 2.0, 3.0, 4.0], &[2, 2]).unwrap();
    let b = a.matmul(&a).unwrap().to_vec::<f32>().unwrap();
    assert_eq!(b, vec![7.0, 10.0, 15.0, 22.0]);
}

#[test]
fn kvstore_binary_runs_mlx_without_ld_library_path() {
    let out = Command::new(kvstore_bin())
        .args(["bench", "mlx", "--quick", "--json"])
        .env_remove("LD_LIBRARY_PATH")
        .env_remove("DYLD_LIBRARY_PATH")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "kvstore bench mlx failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["mlx_version"], "0.32.4");
    let rows = report["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 4, "matmul, two SDPA shapes and slice_update");
    for row in rows {
        assert!(row["seconds"].as_f64().unwrap() > 0.0, "{row}");
        assert!(row["baseline_seconds"].as_f64().unwrap() > 0.0, "{row}");
    }
    let launch = report["launch"].as_array().unwrap();
    assert_eq!(
        launch.len(),
        4,
        "kernels, with a scalar, views and in-place writes"
    );
    for row in launch {
        assert!(row["us_per_node"].as_f64().unwrap() >= 0.0, "{row}");
        assert!(row["nodes"].as_u64().unwrap() > 1, "{row}");
    }
}
