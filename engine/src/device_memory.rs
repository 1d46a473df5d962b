//! Whether an engine's device memory budgets fit its GPU, checked when the engine opens.
//!
//! On a GPU the engine's memory is the weights (and whatever else is live when it opens),
//! the device KV (`kv_budget_bytes`: live and resident sequences together) and what one
//! prefill pass holds in flight (`pass_workspace`: engine/src/pass_memory.rs). Budgets that
//! add up to more than the device has cannot be honoured: the run would fail mid-load with
//! CUDA out of memory, a request or a step at a time. Under the Mooncake trace on the H100
//! the 8B-shaped model came within 4 GB of the card's 81.5 with a 16 GiB KV budget
//! (docs/benchmarks.md, session 37), so a budget a user raises to fill the card fails this
//! way. The engine refuses such budgets at once and says how much would fit, as vLLM refuses
//! a KV cache its `gpu_memory_utilization` leaves no room for. The CPU is not checked: its
//! "device" is the machine's memory, shared with everything else on it.

use crate::EngineConfig;

/// Refuses `kv_budget` bytes of device KV beside `in_use` bytes already live (the weights)
/// and a `pass_workspace`, on a device of `total` bytes; `Ok` when they fit, and for
/// [`EngineConfig::NO_KV_BUDGET`]: without a budget there is nothing to refuse (the engine
/// then holds what its requests need, as `generate` and `bench generate` do).
pub(crate) fn check_fits(
    total: u64,
    in_use: u64,
    kv_budget: u64,
    pass_workspace: u64,
) -> Result<(), String> {
    if kv_budget == EngineConfig::NO_KV_BUDGET {
        return Ok(());
    }
    let need = in_use
        .saturating_add(kv_budget)
        .saturating_add(pass_workspace);
    if need <= total {
        return Ok(());
    }
    let room = total.saturating_sub(in_use).saturating_sub(pass_workspace);
    Err(format!(
        "a device KV budget of {} beside {} already in use (the weights) and a {} prefill pass \
         workspace needs {}, more than this GPU's {}: lower --kv-budget to at most {}{}",
        gib(kv_budget),
        gib(in_use),
        gib(pass_workspace),
        gib(need),
        gib(total),
        gib(room),
        if room == 0 {
            " (nothing is left: lower --pass-workspace, or use a smaller model or a larger GPU)"
        } else {
            " (or lower --pass-workspace)"
        }
    ))
}

/// `bytes` as GiB with two decimals.
fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    const GIB: u64 = 1 << 30;

    #[test]
    fn budgets_that_fit_the_device_pass_and_others_say_what_would() {
        // The H100 (81,559 MiB) with the 8B's 16.06 GB of weights: session 37's 16 GiB of
        // device KV and the 8 GiB workspace fit.
        let h100 = 81_559 << 20;
        let weights = 16_060_000_000;
        assert!(check_fits(h100, weights, 16 * GIB, 8 * GIB).is_ok());
        // 64 GiB does not; what is left beside the weights and the workspace is said.
        let e = check_fits(h100, weights, 64 * GIB, 8 * GIB).unwrap_err();
        let room = h100 - weights - 8 * GIB;
        assert!(e.contains("lower --kv-budget to at most"), "{e}");
        assert!(e.contains(&gib(room)), "{e}");
        assert!(e.contains("this GPU's 79.65 GiB"), "{e}");
        // At exactly the device's size it fits; one byte more does not.
        assert!(check_fits(100, 40, 50, 10).is_ok());
        assert!(check_fits(100, 40, 51, 10).is_err());
        // Weights and workspace alone past the device: nothing left to give the KV.
        let e = check_fits(10 * GIB, 9 * GIB, GIB, 2 * GIB).unwrap_err();
        assert!(e.contains("at most 0.00 GiB (nothing is left"), "{e}");
        // No overflow on absurd budgets.
        assert!(check_fits(h100, weights, u64::MAX - 1, u64::MAX).is_err());
        // No budget (`generate`, `bench generate` without --kv-budget): nothing to refuse.
        // Session 39 found both refused on the H100 before this rule.
        assert!(check_fits(h100, weights, EngineConfig::NO_KV_BUDGET, 8 * GIB).is_ok());
    }
}
