//! Pipeline schedules as data: the checker proves GPipe, 1F1B, interleaved
//! 1F1B and ZB-H1 sound over many shapes and rejects broken schedules; the
//! simulator reproduces the bubble fractions theory predicts and the peak
//! number of activations each stage holds.

use tessera::parallel::pipeline::{gpipe, interleaved_one_f_one_b, one_f_one_b, zero_bubble_h1, Action, Costs, Schedule, ScheduleKind};

/// Every built-in schedule over a range of shapes.
fn all_schedules() -> Vec<Schedule> {
    let mut out = Vec::new();
    for p in 1..=8 {
        for m in 1..=12 {
            out.push(gpipe(p, m).unwrap());
            out.push(one_f_one_b(p, m).unwrap());
            out.push(zero_bubble_h1(p, m).unwrap());
        }
        for v in 2..=4 {
            for groups in 1..=4 {
                out.push(interleaved_one_f_one_b(p, p * groups, v).unwrap());
            }
        }
    }
    out
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-12
}

#[test]
fn every_built_in_schedule_passes_the_checker() {
    for s in all_schedules() {
        s.check().unwrap_or_else(|e| panic!("{e}\n{s}"));
    }
}

#[test]
fn every_stage_forwards_and_backwards_every_unit_once_forward_first() {
    for s in all_schedules() {
        for stage in 0..s.stages() {
            let computes: Vec<Action> = s.actions(stage).iter().copied().filter(Action::is_compute).collect();
            let at = |a: Action| computes.iter().position(|&b| b == a);
            let mut expected = 0;
            for microbatch in 0..s.microbatches() {
                for chunk in 0..s.chunks() {
                    let f = at(Action::Forward { microbatch, chunk }).unwrap();
                    // A whole backward, or its input half then its weight half.
                    match at(Action::Backward { microbatch, chunk }) {
                        Some(b) => {
                            assert!(f < b, "{s}");
                            assert_eq!(
                                (at(Action::BackwardInput { microbatch, chunk }), at(Action::BackwardWeight { microbatch, chunk })),
                                (None, None),
                                "{s}"
                            );
                            expected += 2;
                        }
                        None => {
                            let (bx, bw) =
                                (at(Action::BackwardInput { microbatch, chunk }).unwrap(), at(Action::BackwardWeight { microbatch, chunk }).unwrap());
                            assert!(f < bx && bx < bw, "{s}");
                            expected += 3;
                        }
                    }
                }
            }
            assert_eq!(computes.len(), expected, "{s}");
        }
    }
}

#[test]
fn sends_and_receives_pair_up() {
    for s in all_schedules() {
        let all = s.all_actions().concat();
        let count = |f: fn(&Action) -> bool| all.iter().filter(|a| f(a)).count();
        let sends_act = count(|a| matches!(a, Action::SendActivation { .. }));
        let recvs_act = count(|a| matches!(a, Action::RecvActivation { .. }));
        let sends_grad = count(|a| matches!(a, Action::SendGrad { .. }));
        let recvs_grad = count(|a| matches!(a, Action::RecvGrad { .. }));
        // Every boundary between consecutive virtual stages on different stages
        // carries one activation and one gradient per microbatch.
        let boundaries = if s.stages() == 1 { 0 } else { s.virtual_stages() - 1 };
        let n = boundaries * s.microbatches();
        assert_eq!((sends_act, recvs_act, sends_grad, recvs_grad), (n, n, n, n), "{s}");
    }
}

#[test]
fn one_f_one_b_has_the_textbook_order() {
    let s = one_f_one_b(4, 6).unwrap();
    let text = s.to_string();
    let lines: Vec<&str> = text.lines().skip(1).collect();
    assert_eq!(lines[0], "stage 0: F0.0 F1.0 F2.0 F3.0 B0.0 F4.0 B1.0 F5.0 B2.0 B3.0 B4.0 B5.0");
    assert_eq!(lines[3], "stage 3: F0.0 B0.0 F1.0 B1.0 F2.0 B2.0 F3.0 B3.0 F4.0 B4.0 F5.0 B5.0");
    // Stage 1's work with its transfers.
    let a = s.actions(1);
    assert_eq!(a[0], Action::RecvActivation { from: 0, microbatch: 0, chunk: 0 });
    assert_eq!(a[1], Action::Forward { microbatch: 0, chunk: 0 });
    assert_eq!(a[2], Action::SendActivation { to: 2, microbatch: 0, chunk: 0 });
    // A single stage communicates with nobody.
    assert!(one_f_one_b(1, 4).unwrap().actions(0).iter().all(Action::is_compute));
}

#[test]
fn interleaved_chunks_flow_from_the_last_stage_back_to_the_first() {
    let s = interleaved_one_f_one_b(2, 2, 2).unwrap();
    assert_eq!((s.virtual_stages(), s.virtual_stage(1, 1), s.placement(3)), (4, 3, (1, 1)));
    // Stage 0's chunk 1 is virtual stage 2: its input comes from stage 1's chunk 0.
    assert!(s.actions(0).contains(&Action::RecvActivation { from: 1, microbatch: 0, chunk: 1 }));
    assert!(s.actions(1).contains(&Action::SendActivation { to: 0, microbatch: 0, chunk: 0 }));
    assert!(s.actions(0).contains(&Action::SendGrad { to: 1, microbatch: 0, chunk: 1 }));
    // Forwards go in groups of p microbatches per chunk.
    let text = s.to_string();
    assert_eq!(text.lines().nth(1), Some("stage 0: F0.0 F1.0 F0.1 F1.1 B0.1 B1.1 B0.0 B1.0"));
    // One stage with several chunks hands tensors over locally.
    let one = interleaved_one_f_one_b(1, 3, 3).unwrap();
    one.check().unwrap();
    assert!(one.actions(0).iter().all(Action::is_compute));
}

#[test]
fn schedule_kinds_build_the_same_schedules() {
    assert_eq!(ScheduleKind::GPipe.build(3, 5).unwrap(), gpipe(3, 5).unwrap());
    assert_eq!(ScheduleKind::OneFOneB.build(3, 5).unwrap(), one_f_one_b(3, 5).unwrap());
    assert_eq!(ScheduleKind::Interleaved { chunks: 2 }.build(3, 6).unwrap(), interleaved_one_f_one_b(3, 6, 2).unwrap());
    assert_eq!(ScheduleKind::ZeroBubbleH1.build(3, 5).unwrap(), zero_bubble_h1(3, 5).unwrap());
    // One chunk is plain 1F1B.
    assert_eq!(interleaved_one_f_one_b(3, 5, 1).unwrap(), one_f_one_b(3, 5).unwrap());
}

#[test]
fn bad_shapes_are_refused_with_the_fix() {
    let err = one_f_one_b(0, 4).unwrap_err().to_string();
    assert!(err.contains("number of stages is 0"), "{err}");
    let err = gpipe(2, 0).unwrap_err().to_string();
    assert!(err.contains("number of microbatches is 0"), "{err}");
    let err = interleaved_one_f_one_b(2, 4, 0).unwrap_err().to_string();
    assert!(err.contains("number of chunks is 0"), "{err}");
    let err = interleaved_one_f_one_b(4, 6, 2).unwrap_err().to_string();
    assert!(err.contains("6 microbatches is not a multiple of the 4 stages") && err.contains("use 4 or 8 microbatches"), "{err}");
    let err = interleaved_one_f_one_b(4, 3, 2).unwrap_err().to_string();
    assert!(err.contains("use 4 microbatches"), "{err}");
}

// The bubble. With per-unit costs f (forward) and b (backward) and instant
// transfers, the last microbatch cannot start on stage s before s forwards
// have gone by, and the first backward reaches stage s only after the p−1−s
// later stages ran theirs: every stage idles (p−1)·(f+b) in a step of
// m·(f+b) + (p−1)·(f+b). So the bubble fraction of GPipe and 1F1B is
//     (p−1) / (m + p − 1),
// whatever the ratio b/f. Interleaving splits each stage into v chunks whose
// costs are f/v and b/v, while the warm-up and drain still cross p−1 stage
// boundaries, now of a chunk each: the idle time per stage falls to
// (p−1)·(f+b)/v against m·(f+b) of work, so the fraction is
//     (p−1) / (v·m + p − 1).

#[test]
fn gpipe_and_one_f_one_b_bubbles_are_p_minus_1_over_m_plus_p_minus_1() {
    for (f, b) in [(1.0, 1.0), (1.0, 2.0), (2.0, 3.0)] {
        for p in 1..=8 {
            for m in 1..=12 {
                let theory = (p - 1) as f64 / (m + p - 1) as f64;
                for s in [gpipe(p, m).unwrap(), one_f_one_b(p, m).unwrap()] {
                    let sim = s.simulate(&Costs::new(f, b)).unwrap();
                    assert!(close(sim.bubble_fraction(), theory), "{}: p={p} m={m} f={f} b={b}: {} vs {theory}", s.name(), sim.bubble_fraction());
                    assert!(close(sim.makespan(), (m + p - 1) as f64 * (f + b)), "{}", s.name());
                    for st in sim.stages() {
                        assert!(close(st.busy, m as f64 * (f + b)));
                        assert!(close(st.idle, (p - 1) as f64 * (f + b)));
                    }
                }
            }
        }
    }
}

#[test]
fn interleaving_divides_the_bubble_by_the_chunks() {
    for (f, b) in [(1.0, 1.0), (1.0, 2.0)] {
        for p in 1..=8 {
            for v in 2..=4 {
                for groups in 1..=4 {
                    let m = p * groups;
                    let s = interleaved_one_f_one_b(p, m, v).unwrap();
                    // Per-chunk costs are the whole stage's divided by v; keep them whole
                    // numbers so the comparison is exact: a stage's forward costs v·f.
                    let sim = s.simulate(&Costs::new(f, b)).unwrap();
                    let theory = (p - 1) as f64 / (v * m + p - 1) as f64;
                    assert!(close(sim.bubble_fraction(), theory), "p={p} m={m} v={v} f={f} b={b}: {} vs {theory}\n{s}", sim.bubble_fraction());
                    let plain = one_f_one_b(p, m).unwrap().simulate(&Costs::new(v as f64 * f, v as f64 * b)).unwrap();
                    assert!(sim.makespan() <= plain.makespan(), "p={p} m={m} v={v}: interleaving must not be slower");
                }
            }
        }
    }
}

/// The published bubble of ZB-H1 (Qi et al., ICLR 2024, section 3.1): with
/// forward `F`, input half `B` and weight half `W`, each stage idles
/// `(p − 1)·(F + B − W)`, against 1F1B's `(p − 1)·(F + B + W)`, whenever
/// there are at least as many microbatches as stages and `W` is no larger
/// than `F` or `B`.
#[test]
fn zero_bubble_h1_idles_p_minus_1_times_f_plus_b_minus_w() {
    let grid = [0.5, 1.0, 2.0, 3.0];
    for p in 1..=8 {
        for m in p..=12 {
            let s = zero_bubble_h1(p, m).unwrap();
            let costs = grid.into_iter().flat_map(|f| grid.into_iter().flat_map(move |b| grid.into_iter().map(move |w| (f, b, w))));
            for (f, b, w) in costs {
                if w > f || w > b {
                    continue;
                }
                let sim = s.simulate(&Costs::new(f, b + w).with_weight(w)).unwrap();
                let idle = (p - 1) as f64 * (f + b - w);
                for st in sim.stages() {
                    assert!(close(st.busy, m as f64 * (f + b + w)), "p={p} m={m} F={f} B={b} W={w}");
                    assert!(close(st.idle, idle), "p={p} m={m} F={f} B={b} W={w}: idle {} vs {idle}\n{s}", st.idle);
                }
                let theory = idle / (idle + m as f64 * (f + b + w));
                assert!(close(sim.bubble_fraction(), theory), "p={p} m={m}");
                if w == f && w == b && p > 1 {
                    // Equal halves: a third of 1F1B's bubble.
                    let ofob = one_f_one_b(p, m).unwrap().simulate(&Costs::new(f, b + w).with_weight(w)).unwrap();
                    assert!(close(3.0 * sim.stages()[0].idle, ofob.stages()[0].idle), "p={p} m={m}");
                }
            }
        }
    }
}

#[test]
fn zero_bubble_h1_is_never_slower_than_one_f_one_b() {
    // Any shape (fewer microbatches than stages too), any split of the
    // backward (a weight half larger than the forward too), any latency.
    let grid = [0.5, 1.0, 3.0];
    for p in 1..=6 {
        for m in 1..=9 {
            let (zb, ofob) = (zero_bubble_h1(p, m).unwrap(), one_f_one_b(p, m).unwrap());
            for &f in &grid {
                for &b in &grid {
                    for w in [0.0, 0.25, 1.0, 3.0] {
                        for latency in [0.0, 0.5] {
                            let costs = Costs::new(f, b + w).with_weight(w).with_latency(latency);
                            let (z, o) = (zb.simulate(&costs).unwrap().makespan(), ofob.simulate(&costs).unwrap().makespan());
                            assert!(z <= o + 1e-12, "p={p} m={m} F={f} B={b} W={w} latency={latency}: ZB-H1 {z} vs 1F1B {o}");
                        }
                    }
                }
            }
        }
    }
}

#[test]
fn zero_bubble_h1_holds_at_most_p_microbatches_on_every_stage() {
    // A unit is held from its forward to its weight half: 1F1B's first-stage
    // peak, on every stage.
    for p in 1..=8 {
        for m in 1..=12 {
            let s = zero_bubble_h1(p, m).unwrap();
            assert_eq!(s.peak_in_flight(), vec![p.min(m); p], "p={p} m={m}");
            assert_eq!(s.peak_in_flight().iter().max(), one_f_one_b(p, m).unwrap().peak_in_flight().iter().max());
        }
    }
}

#[test]
fn zero_bubble_h1_has_the_published_order() {
    // Stage s: 1F1B's order with the input halves, and the weight half of
    // microbatch j right after the input half of microbatch j + s.
    let s = ScheduleKind::ZeroBubbleH1.build(4, 6).unwrap();
    let text = s.to_string();
    let lines: Vec<&str> = text.lines().skip(1).collect();
    let expected = [
        "stage 0: F0.0 F1.0 F2.0 F3.0 Bx0.0 Bw0.0 F4.0 Bx1.0 Bw1.0 F5.0 Bx2.0 Bw2.0 Bx3.0 Bw3.0 Bx4.0 Bw4.0 Bx5.0 Bw5.0",
        "stage 1: F0.0 F1.0 F2.0 Bx0.0 F3.0 Bx1.0 Bw0.0 F4.0 Bx2.0 Bw1.0 F5.0 Bx3.0 Bw2.0 Bx4.0 Bw3.0 Bx5.0 Bw4.0 Bw5.0",
        "stage 2: F0.0 F1.0 Bx0.0 F2.0 Bx1.0 F3.0 Bx2.0 Bw0.0 F4.0 Bx3.0 Bw1.0 F5.0 Bx4.0 Bw2.0 Bx5.0 Bw3.0 Bw4.0 Bw5.0",
        "stage 3: F0.0 Bx0.0 F1.0 Bx1.0 F2.0 Bx2.0 F3.0 Bx3.0 Bw0.0 F4.0 Bx4.0 Bw1.0 F5.0 Bx5.0 Bw2.0 Bw3.0 Bw4.0 Bw5.0",
    ];
    assert_eq!(lines, expected);
    assert_eq!(s.name(), "ZB-H1");
}

#[test]
fn the_checker_rejects_broken_split_backwards() {
    let f = Action::Forward { microbatch: 0, chunk: 0 };
    let (b, bx, bw) =
        (Action::Backward { microbatch: 0, chunk: 0 }, Action::BackwardInput { microbatch: 0, chunk: 0 }, Action::BackwardWeight { microbatch: 0, chunk: 0 });
    let err = |actions: Vec<Action>| Schedule::from_actions("bad", 1, 1, vec![actions]).unwrap_err().to_string();
    let e = err(vec![f, bw, bx]);
    assert!(e.contains("action 1 (`Bw0.0`): its input half has not run; run Bx0.0 first"), "{e}");
    let e = err(vec![f, bx, bw, bw]);
    assert!(e.contains("action 3 (`Bw0.0`)") && e.contains("already computed"), "{e}");
    let e = err(vec![f, b, bw]);
    assert!(e.contains("already computed (by its whole backward"), "{e}");
    let e = err(vec![f, bx, b]);
    assert!(e.contains("action 2 (`B0.0`)") && e.contains("already ran"), "{e}");
    let e = err(vec![f, bx]);
    assert!(e.contains("never runs the weight half (Bw) of the backward of microbatch 0"), "{e}");
    // A weight half before its input half on another stage's gradient: the
    // receive must come before the input half, whatever the weight half does.
    let mut actions = zero_bubble_h1(2, 2).unwrap().all_actions().to_vec();
    let recv = actions[0].iter().position(|a| matches!(a, Action::RecvGrad { microbatch: 0, .. })).unwrap();
    let recv = actions[0].remove(recv);
    actions[0].push(recv);
    let e = Schedule::from_actions("bad", 2, 1, actions).unwrap_err().to_string();
    assert!(e.contains("its output's gradient has not been received"), "{e}");
    assert!(Schedule::from_actions("ok", 1, 1, vec![vec![f, bx, bw]]).is_ok());
}

#[test]
fn transfer_latency_lengthens_the_step() {
    // GPipe: the first microbatch crosses p−1 links forward and p−1 back.
    for p in 1..=6 {
        for m in 1..=8 {
            let sim = gpipe(p, m).unwrap().simulate(&Costs::new(1.0, 2.0).with_latency(0.5)).unwrap();
            let theory = (m + p - 1) as f64 * 3.0 + 2.0 * (p - 1) as f64 * 0.5;
            assert!(close(sim.makespan(), theory), "p={p} m={m}: {} vs {theory}", sim.makespan());
        }
    }
    let fast = one_f_one_b(4, 8).unwrap().simulate(&Costs::new(1.0, 2.0)).unwrap();
    let slow = one_f_one_b(4, 8).unwrap().simulate(&Costs::new(1.0, 2.0).with_latency(0.25)).unwrap();
    assert!(slow.makespan() > fast.makespan());
    assert_eq!(slow.busy_time(), fast.busy_time());
}

#[test]
fn bad_costs_are_refused() {
    let s = one_f_one_b(2, 2).unwrap();
    let err = s.simulate(&Costs::new(-1.0, 1.0)).unwrap_err().to_string();
    assert!(err.contains("forward cost is -1"), "{err}");
    assert!(s.simulate(&Costs::new(1.0, f64::NAN)).is_err());
    assert!(s.simulate(&Costs::new(1.0, 1.0).with_latency(f64::INFINITY)).is_err());
    assert_eq!(s.simulate(&Costs::new(0.0, 0.0)).unwrap().bubble_fraction(), 0.0);
    let err = s.simulate(&Costs::new(1.0, 1.0).with_weight(2.0)).unwrap_err().to_string();
    assert!(err.contains("the weight half costs 2 of a backward that costs 1"), "{err}");
    assert!(s.simulate(&Costs::new(1.0, 1.0).with_weight(-0.5)).is_err());
}

#[test]
fn peak_activations_gpipe_holds_all_one_f_one_b_at_most_p() {
    for p in 1..=8 {
        for m in 1..=12 {
            assert_eq!(gpipe(p, m).unwrap().peak_in_flight(), vec![m; p]);
            let peaks = one_f_one_b(p, m).unwrap().peak_in_flight();
            assert_eq!(peaks, (0..p).map(|s| (p - s).min(m)).collect::<Vec<_>>(), "p={p} m={m}");
            assert!(peaks.iter().all(|&n| n <= p));
            let sim = one_f_one_b(p, m).unwrap().simulate(&Costs::new(1.0, 1.0)).unwrap();
            assert_eq!(sim.stages().iter().map(|s| s.peak_in_flight).collect::<Vec<_>>(), peaks);
        }
    }
}

#[test]
fn peak_activations_of_interleaved_follow_its_warm_up() {
    for p in 1..=6 {
        for v in 2..=4 {
            for groups in 1..=3 {
                let m = p * groups;
                let peaks = interleaved_one_f_one_b(p, m, v).unwrap().peak_in_flight();
                // The warm-up forwards and the steady state's one more, in chunk units.
                let expected: Vec<usize> = (0..p).map(|s| ((v - 1) * p + 2 * (p - s - 1) + 1).min(m * v)).collect();
                assert_eq!(peaks, expected, "p={p} m={m} v={v}");
            }
        }
    }
}

#[test]
fn the_checker_rejects_a_backward_before_its_forward() {
    let actions = vec![vec![Action::Backward { microbatch: 0, chunk: 0 }, Action::Forward { microbatch: 0, chunk: 0 }]];
    let err = Schedule::from_actions("bad", 1, 1, actions).unwrap_err().to_string();
    assert!(err.contains("stage 0, action 0 (`B0.0`): its forward has not run; run F0.0 first"), "{err}");
}

#[test]
fn the_checker_rejects_a_missing_receive() {
    let mut actions = one_f_one_b(2, 2).unwrap().all_actions().to_vec();
    actions[1].retain(|a| !matches!(a, Action::RecvActivation { microbatch: 1, .. }));
    let err = Schedule::from_actions("bad", 2, 1, actions).unwrap_err().to_string();
    assert!(err.contains("its input has not been received; put RecvActivation { from: 0, microbatch: 1, chunk: 0 } before it"), "{err}");
}

#[test]
fn the_checker_rejects_a_send_to_the_wrong_stage() {
    let mut actions = one_f_one_b(3, 2).unwrap().all_actions().to_vec();
    for a in &mut actions[0] {
        if let Action::SendActivation { to, .. } = a {
            *to = 2;
        }
    }
    let err = Schedule::from_actions("bad", 2, 1, actions).unwrap_err().to_string();
    assert!(err.contains("the consumer of its output is on stage 1, not stage 2"), "{err}");
}

#[test]
fn the_checker_rejects_an_unreceived_send() {
    // Stage 0 sends its activation a second time, and nobody takes it.
    let mut actions = gpipe(2, 1).unwrap().all_actions().to_vec();
    actions[0].push(Action::SendActivation { to: 1, microbatch: 0, chunk: 0 });
    let err = Schedule::from_actions("bad", 1, 1, actions).unwrap_err().to_string();
    assert!(err.contains("which never receives it") && err.contains("add RecvActivation { from: 0, microbatch: 0, chunk: 0 } on stage 1"), "{err}");
}

#[test]
fn the_checker_finds_a_deadlock() {
    // Stage 0 waits for the gradient before it has sent the activation that
    // stage 1 needs to produce it.
    let (f, b) = (Action::Forward { microbatch: 0, chunk: 0 }, Action::Backward { microbatch: 0, chunk: 0 });
    let actions = vec![
        vec![f, Action::RecvGrad { from: 1, microbatch: 0, chunk: 0 }, Action::SendActivation { to: 1, microbatch: 0, chunk: 0 }, b],
        vec![Action::RecvActivation { from: 0, microbatch: 0, chunk: 0 }, f, b, Action::SendGrad { to: 0, microbatch: 0, chunk: 0 }],
    ];
    let err = Schedule::from_actions("bad", 1, 1, actions).unwrap_err().to_string();
    assert!(err.contains("deadlock: stage 0 at action 1 (`recv-grad 0.0 ← 1`), stage 1 at action 0 (`recv-act 0.0 ← 0`)"), "{err}");
}

#[test]
fn the_checker_rejects_out_of_range_and_repeated_work() {
    let f = Action::Forward { microbatch: 0, chunk: 0 };
    let err = Schedule::from_actions("bad", 1, 1, vec![vec![Action::Forward { microbatch: 1, chunk: 0 }]]).unwrap_err().to_string();
    assert!(err.contains("microbatch 1 is out of range"), "{err}");
    let err = Schedule::from_actions("bad", 1, 1, vec![vec![f, f]]).unwrap_err().to_string();
    assert!(err.contains("already ran"), "{err}");
    let err = Schedule::from_actions("bad", 1, 1, vec![vec![f, Action::SendActivation { to: 0, microbatch: 0, chunk: 0 }]]).unwrap_err().to_string();
    assert!(err.contains("no stage consumes its output"), "{err}");
    assert!(Schedule::from_actions("bad", 1, 1, vec![]).is_err());
}

#[test]
fn a_hand_written_schedule_that_is_sound_is_accepted() {
    let s = one_f_one_b(3, 4).unwrap();
    let again = Schedule::from_actions("mine", 4, 1, s.all_actions().to_vec()).unwrap();
    assert_eq!(again.all_actions(), s.all_actions());
    assert_eq!(again.name(), "mine");
}

#[test]
fn the_chrome_trace_has_a_track_per_stage_and_a_slice_per_computation() {
    let s = interleaved_one_f_one_b(4, 8, 2).unwrap();
    let sim = s.simulate(&Costs::new(1.0, 2.0).with_latency(0.5)).unwrap();
    let trace = sim.to_chrome_trace();
    assert!(trace.starts_with("{\"traceEvents\":[") && trace.trim_end().ends_with('}'));
    for stage in 0..4 {
        assert!(trace.contains(&format!("\"args\":{{\"name\":\"stage {stage}\"}}")), "stage {stage}");
    }
    assert_eq!(trace.matches("\"cat\":\"forward\"").count(), 4 * 8 * 2);
    assert_eq!(trace.matches("\"cat\":\"backward\"").count(), 4 * 8 * 2);
    assert!(trace.contains("\"cat\":\"wait\""), "latency makes some stage wait");
    // Balanced braces and brackets: the JSON is at least well nested.
    let depth = trace.chars().try_fold(0i64, |d, c| {
        let d = d + match c {
            '{' | '[' => 1,
            '}' | ']' => -1,
            _ => 0,
        };
        (d >= 0).then_some(d)
    });
    assert_eq!(depth, Some(0));
    assert_eq!(sim.events().len(), s.all_actions().iter().map(Vec::len).sum::<usize>());

    let zb = zero_bubble_h1(4, 8).unwrap().simulate(&Costs::new(1.0, 2.0)).unwrap().to_chrome_trace();
    assert_eq!(zb.matches("\"cat\":\"backward-input\"").count(), 4 * 8);
    assert_eq!(zb.matches("\"cat\":\"backward-weight\"").count(), 4 * 8);
    assert!(zb.contains("\"name\":\"Bw7.0\""));
}
