//! What a search may not change: the parts of a layout a user fixes
//! (`tessera plan --fix tp=8 --fix zero=0`), for a cluster's constraints, a
//! feature set to compare with, or a question about one degree.

use crate::estimate::Layout;
use crate::memory::ZeroStage;
use tessera_core::{Error, Result};
use tessera_nn::module::RecomputeOverride;
use tessera_parallel::pipeline::ScheduleKind;

/// The fixed parts of a layout; `None` leaves a part to the search.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Fixed {
    /// Data-parallel replicas.
    pub dp: Option<usize>,
    /// Tensor-parallel degree.
    pub tp: Option<usize>,
    /// Pipeline stages.
    pub pp: Option<usize>,
    /// Expert-parallel degree.
    pub ep: Option<usize>,
    /// Context-parallel degree.
    pub cp: Option<usize>,
    /// Sequence parallelism.
    pub sp: Option<bool>,
    /// The pipeline schedules allowed (`interleaved` fixes the kind, any
    /// chunks): one, or several (`schedule=1f1b,interleaved`).
    pub schedule: Option<Vec<ScheduleName>>,
    /// Sequences per micro-batch.
    pub micro_batch: Option<usize>,
    /// The recompute policy.
    pub recompute: Option<RecomputeOverride>,
    /// The ZeRO stage.
    pub zero: Option<ZeroStage>,
    /// ZeRO-Offload on or off.
    pub offload: Option<bool>,
}

/// A pipeline schedule by name, its chunks left open.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScheduleName {
    /// GPipe.
    GPipe,
    /// 1F1B.
    OneFOneB,
    /// Interleaved 1F1B with any number of chunks.
    Interleaved,
    /// ZB-H1, the zero-bubble schedule.
    ZeroBubbleH1,
}

/// The keys [`Fixed::parse`] takes.
pub const KEYS: &str = "dp, tp, pp, ep, cp, sp, schedule, micro_batch, recompute, zero, offload";

impl Fixed {
    /// Parses `KEY=VALUE` items: `dp`, `tp`, `pp`, `ep`, `cp` and `micro_batch`
    /// (positive integers), `sp` (`true`/`false`), `schedule` (`gpipe`,
    /// `1f1b`, `interleaved`, `zb-h1`, or several comma-separated), `recompute` (`none`, `declared`, `full`),
    /// `zero` (0 to 3), `offload` (`true`/`false`: ZeRO-Offload). A key given twice, an unknown key or a bad value is
    /// an error naming it.
    pub fn parse(items: &[String]) -> Result<Fixed> {
        let mut f = Fixed::default();
        for item in items {
            let bad = |why: String| Error::invalid("plan --fix", format!("`{item}`: {why}"));
            let (key, value) = item.split_once('=').ok_or_else(|| bad(format!("give KEY=VALUE, KEY one of {KEYS}")))?;
            let (key, value) = (key.trim(), value.trim());
            let degree = || -> Result<usize> {
                value.parse::<usize>().ok().filter(|&v| v > 0).ok_or_else(|| bad(format!("{key} takes a positive integer, not `{value}`")))
            };
            let already = match key {
                "dp" => f.dp.replace(degree()?).is_some(),
                "tp" => f.tp.replace(degree()?).is_some(),
                "pp" => f.pp.replace(degree()?).is_some(),
                "ep" => f.ep.replace(degree()?).is_some(),
                "cp" => f.cp.replace(degree()?).is_some(),
                "micro_batch" => f.micro_batch.replace(degree()?).is_some(),
                "sp" => f.sp.replace(value.parse::<bool>().map_err(|_| bad(format!("sp takes true or false, not `{value}`")))?).is_some(),
                "offload" => f.offload.replace(value.parse::<bool>().map_err(|_| bad(format!("offload takes true or false, not `{value}`")))?).is_some(),
                "schedule" => {
                    let names = value
                        .split(',')
                        .map(|name| match name.trim() {
                            "gpipe" => Ok(ScheduleName::GPipe),
                            "1f1b" => Ok(ScheduleName::OneFOneB),
                            "interleaved" => Ok(ScheduleName::Interleaved),
                            "zb-h1" => Ok(ScheduleName::ZeroBubbleH1),
                            _ => Err(bad(format!("schedule is gpipe, 1f1b, interleaved or zb-h1 (or several, comma-separated), not `{value}`"))),
                        })
                        .collect::<Result<Vec<_>>>()?;
                    f.schedule.replace(names).is_some()
                }
                "recompute" => {
                    let r = match value {
                        "none" | "off" => RecomputeOverride::Off,
                        "declared" => RecomputeOverride::AsDeclared,
                        "full" => RecomputeOverride::Full,
                        _ => return Err(bad(format!("recompute is none, declared or full, not `{value}`"))),
                    };
                    f.recompute.replace(r).is_some()
                }
                "zero" => {
                    let z = match value {
                        "0" => ZeroStage::None,
                        "1" => ZeroStage::One,
                        "2" => ZeroStage::Two,
                        "3" => ZeroStage::Three,
                        _ => return Err(bad(format!("zero is a stage from 0 to 3, not `{value}`"))),
                    };
                    f.zero.replace(z).is_some()
                }
                _ => return Err(bad(format!("unknown key `{key}`; fix one of {KEYS}"))),
            };
            if already {
                return Err(bad(format!("{key} is fixed twice")));
            }
        }
        Ok(f)
    }

    /// Whether `layout` keeps every fixed part.
    pub fn admits(&self, l: &Layout) -> bool {
        let same = |fixed: Option<usize>, v: usize| fixed.is_none_or(|f| f == v);
        let schedule = match l.schedule {
            ScheduleKind::GPipe => ScheduleName::GPipe,
            ScheduleKind::OneFOneB => ScheduleName::OneFOneB,
            ScheduleKind::Interleaved { .. } => ScheduleName::Interleaved,
            ScheduleKind::ZeroBubbleH1 => ScheduleName::ZeroBubbleH1,
        };
        same(self.dp, l.dp)
            && same(self.tp, l.tp)
            && same(self.pp, l.pp)
            && same(self.ep, l.ep)
            && same(self.cp, l.cp)
            && same(self.micro_batch, l.micro_batch)
            && self.sp.is_none_or(|s| s == l.sp)
            // A schedule is fixed for pipelines; one stage has none.
            && (l.pp == 1 || self.schedule.as_ref().is_none_or(|allowed| allowed.contains(&schedule)))
            && self.recompute.is_none_or(|r| r == l.recompute)
            && self.zero.is_none_or(|z| z == l.zero)
            && self.offload.is_none_or(|o| o == l.offloaded())
    }

    /// Whether nothing is fixed.
    pub fn is_empty(&self) -> bool {
        *self == Fixed::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn items(s: &[&str]) -> Vec<String> {
        s.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn fixed_parts_parse_and_filter_layouts() {
        let f = Fixed::parse(&items(&["tp=8", "sp=false", "zero=0", "recompute=full", "schedule=interleaved"])).unwrap();
        assert_eq!(
            (f.tp, f.sp, f.zero, f.recompute, f.schedule.clone()),
            (Some(8), Some(false), Some(ZeroStage::None), Some(RecomputeOverride::Full), Some(vec![ScheduleName::Interleaved]))
        );
        assert!(Fixed::default().is_empty() && !f.is_empty());
        let base = Layout {
            dp: 4,
            tp: 8,
            pp: 2,
            ep: 1,
            cp: 1,
            sp: false,
            schedule: ScheduleKind::Interleaved { chunks: 2 },
            micro_batch: 1,
            grad_accum: 8,
            seq_len: 2048,
            recompute: RecomputeOverride::Full,
            zero: ZeroStage::None,
            compute: tessera_core::DType::BF16,
            half_params: true,
            bucket_bytes: 1 << 20,
            offload: false,
        };
        assert!(f.admits(&base));
        let off = Fixed::parse(&items(&["offload=false"])).unwrap();
        let on = Fixed::parse(&items(&["offload=true"])).unwrap();
        let offloaded = Layout { zero: ZeroStage::Two, offload: true, ..base };
        assert!(off.admits(&base) && !on.admits(&base) && on.admits(&offloaded) && !off.admits(&offloaded));
        assert!(Fixed::parse(&items(&["offload=yes"])).unwrap_err().to_string().contains("true or false"));
        assert!(f.admits(&Layout { schedule: ScheduleKind::Interleaved { chunks: 4 }, ..base }), "any chunks");
        assert!(f.admits(&Layout { pp: 1, schedule: ScheduleKind::OneFOneB, ..base }), "one stage has no schedule");
        for other in [
            Layout { tp: 4, ..base },
            Layout { sp: true, ..base },
            Layout { zero: ZeroStage::One, ..base },
            Layout { recompute: RecomputeOverride::Off, ..base },
            Layout { schedule: ScheduleKind::GPipe, ..base },
        ] {
            assert!(!f.admits(&other), "{other:?}");
        }
        // Several schedules: any of them.
        let older = Fixed::parse(&items(&["schedule=gpipe, 1f1b,interleaved"])).unwrap();
        assert!(older.admits(&base) && older.admits(&Layout { schedule: ScheduleKind::GPipe, ..base }));
        assert!(!older.admits(&Layout { schedule: ScheduleKind::ZeroBubbleH1, ..base }));
        assert!(Fixed::parse(&items(&["schedule=zb-h1"])).unwrap().admits(&Layout { schedule: ScheduleKind::ZeroBubbleH1, ..base }));
    }

    #[test]
    fn bad_items_are_refused_naming_them() {
        for (item, says) in [
            ("tp", "KEY=VALUE"),
            ("tp=0", "positive integer"),
            ("tp=x", "positive integer"),
            ("sp=yes", "true or false"),
            ("zero=4", "0 to 3"),
            ("recompute=some", "none, declared or full"),
            ("schedule=zb", "gpipe, 1f1b, interleaved or zb-h1"),
            ("schedule=1f1b,zb", "gpipe, 1f1b, interleaved or zb-h1"),
            ("vpp=2", "unknown key `vpp`"),
        ] {
            let e = Fixed::parse(&items(&[item])).unwrap_err().to_string();
            assert!(e.contains(item) && e.contains(says), "{item}: {e}");
        }
        let e = Fixed::parse(&items(&["tp=2", "tp=4"])).unwrap_err().to_string();
        assert!(e.contains("fixed twice"), "{e}");
    }
}
