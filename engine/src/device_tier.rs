//! [`DeviceTier`]: whether the device tier holds copies of the host tiers' blocks.

use std::fmt;
use std::str::FromStr;

use serde::{Deserialize, Serialize};

/// How the device tier (resident sequences, `cache::ResidentPool`) relates to the host tiers
/// (RAM, SSD, remote).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DeviceTier {
    /// Every full block is exported to the host tiers when it is published (after a
    /// prompt's prefill, and as a sequence finishes): the host tiers hold copies of what
    /// the device holds, other requests find a prompt's blocks while it still decodes, and
    /// the remote tier gets them at once.
    #[default]
    Inclusive,
    /// A sequence's blocks are exported when it leaves the device (evicted, or at a
    /// flush): RAM holds only what the device does not, so the tiers together hold more
    /// distinct blocks. Other requests find a running prompt's blocks only after its
    /// sequence has left the device, the remote tier gets them as late, and the tail a
    /// hand-over cuts off (the reply the next turn re-rendered) is not exported.
    /// Shares of a resident prefix become forks.
    Exclusive,
}

impl DeviceTier {
    /// Its name on the command line.
    pub fn name(self) -> &'static str {
        match self {
            DeviceTier::Inclusive => "inclusive",
            DeviceTier::Exclusive => "exclusive",
        }
    }
}

impl fmt::Display for DeviceTier {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for DeviceTier {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "inclusive" => Ok(DeviceTier::Inclusive),
            "exclusive" => Ok(DeviceTier::Exclusive),
            _ => Err(format!(
                "unknown device tier `{s}`: one of inclusive, exclusive"
            )),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_unknown_ones_are_refused() {
        for t in [DeviceTier::Inclusive, DeviceTier::Exclusive] {
            assert_eq!(t.name().parse::<DeviceTier>(), Ok(t));
            assert_eq!(
                serde_json::to_string(&t).unwrap(),
                format!("\"{}\"", t.name())
            );
        }
        assert_eq!(DeviceTier::default(), DeviceTier::Inclusive);
        let e = "both".parse::<DeviceTier>().unwrap_err();
        assert!(e.contains("one of inclusive, exclusive"), "{e}");
    }
}
