//! The few collectives a save or load needs over the whole mesh, composed
//! from the per-axis groups of [`Cx::groups`]: a reduction over tp, then
//! ep, dp and pp covers every rank once, because the groups of the four
//! axes tile the mesh.

use tessera_core::tensor::Tensor;
use tessera_core::{Error, Result};
use tessera_nn::module::Cx;

/// The most bytes of a failing rank's message carried to the others.
const MESSAGE_BYTES: usize = 2048;

/// Sums `t` over every rank of the mesh.
fn sum_over_mesh(cx: &Cx, mut t: Tensor) -> Result<Tensor> {
    let g = cx.groups();
    for group in [&g.tp, &g.ep, &g.dp, &g.pp] {
        t = group.all_reduce_sum(&t)?;
    }
    Ok(t)
}

/// This rank's place in mesh order (pp, then dp, ep, tp fastest), and the
/// number of ranks.
fn mesh_index(cx: &Cx) -> (usize, usize) {
    let g = cx.groups();
    let index = ((g.pp.rank() * g.dp.size() + g.dp.rank()) * g.ep.size() + g.ep.rank()) * g.tp.size() + g.tp.rank();
    (index, g.pp.size() * g.dp.size() * g.ep.size() * g.tp.size())
}

/// `pp1 dp0 ep0 tp1` for the rank at mesh index `i`.
fn describe(cx: &Cx, i: usize) -> String {
    let g = cx.groups();
    let (tp, ep, dp) = (g.tp.size(), g.ep.size(), g.dp.size());
    format!("pp{} dp{} ep{} tp{}", i / (tp * ep * dp), i / (tp * ep) % dp, i / tp % ep, i % tp)
}

/// Agrees, on every rank of the mesh, on whether `what` worked everywhere.
///
/// Every rank calls it with its own outcome. Where every rank succeeded,
/// each gets its outcome back. Otherwise a failing rank gets its own error
/// back (the root cause), and every other rank an [`Error::PeerFailed`]
/// carrying the first failing rank's (in mesh order) message, over the
/// communicators: whichever rank's error a user sees, it says what went
/// wrong, and nothing needs the disk (which may be what failed).
pub(crate) fn agree<T>(cx: &Cx, what: &str, outcome: Result<T>) -> Result<T> {
    let (me, world) = mesh_index(cx);
    let mut flags = vec![0.0f64; world];
    flags[me] = f64::from(u8::from(outcome.is_err()));
    let flags = sum_over_mesh(cx, Tensor::from_vec(flags, [world], cx.device())?)?.to_vec::<f64>()?;
    let failed: Vec<usize> = (0..world).filter(|&i| flags[i] > 0.5).collect();
    let Some(&first) = failed.first() else { return outcome };
    // The first failing rank's message, as bytes summed with everyone
    // else's zeros (exact in f32).
    let mut bytes = vec![0.0f32; MESSAGE_BYTES];
    if let (true, Err(e)) = (me == first, &outcome) {
        let text = e.to_string();
        let mut end = text.len().min(MESSAGE_BYTES);
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        for (slot, b) in bytes.iter_mut().zip(&text.as_bytes()[..end]) {
            *slot = f32::from(*b);
        }
    }
    let bytes = sum_over_mesh(cx, Tensor::from_vec(bytes, [MESSAGE_BYTES], cx.device())?)?.to_vec::<f32>()?;
    // A failing rank reports its own error: the root cause.
    let _ = outcome?;
    let text: Vec<u8> = bytes.iter().map(|&b| b as u8).take_while(|&b| b != 0).collect();
    let others = match failed.len() - 1 {
        0 => String::new(),
        n => format!(" (and {n} other rank(s))"),
    };
    Err(Error::PeerFailed {
        rank: first,
        reason: format!("{what} failed on rank {first} ({}){others}: {}", describe(cx, first), String::from_utf8_lossy(&text)),
    })
}

/// Rank 0's `value`, on every rank of the mesh.
pub(crate) fn broadcast(cx: &Cx, value: u32) -> Result<u32> {
    let g = cx.groups();
    let mut t = Tensor::from_vec(vec![value], [1], cx.device())?;
    // Outward from rank 0: first along pp (to every coordinate-0 rank of
    // the other axes), then dp, ep and tp.
    for group in [&g.pp, &g.dp, &g.ep, &g.tp] {
        t = group.broadcast(&t, 0)?;
    }
    Ok(t.to_vec::<u32>()?[0])
}

#[cfg(test)]
mod tests {
    use super::*;
    use tessera_core::Device;
    use tessera_dist::inproc::{mesh_groups, InProcess};
    use tessera_dist::mesh::Mesh;

    /// Runs `f(rank, cx)` on every rank of a `spec` mesh of threads.
    fn on_mesh<T: Send>(spec: &str, world: usize, f: impl Fn(usize, &Cx) -> T + Sync) -> Vec<T> {
        let mesh = Mesh::parse(spec, world, world).unwrap();
        let ip = InProcess::new(world).unwrap();
        std::thread::scope(|s| {
            let handles: Vec<_> = (0..world)
                .map(|r| {
                    let (mesh, ip, f) = (&mesh, &ip, &f);
                    s.spawn(move || {
                        let dev = Device::cpu();
                        let cx = Cx::new(dev.clone()).with_groups(mesh_groups(ip, mesh, r, &dev).unwrap());
                        f(r, &cx)
                    })
                })
                .collect();
            handles.into_iter().map(|h| h.join().unwrap()).collect()
        })
    }

    #[test]
    fn every_rank_learns_the_first_failure_and_its_message() {
        // Ranks 5 and 6 of pp2 × dp2 × tp2 fail; every other rank gets rank 5's message.
        let out = on_mesh("pp2,dp2,tp2", 8, |r, cx| {
            let outcome = if r == 5 || r == 6 {
                Err(Error::io(std::path::Path::new("/ckpt/x"), std::io::Error::other(format!("disk of rank {r} is full ✗"))))
            } else {
                Ok(r)
            };
            agree(cx, "writing", outcome).map_err(|e| e.to_string())
        });
        for (r, o) in out.iter().enumerate() {
            let e = o.as_ref().unwrap_err();
            if r == 5 || r == 6 {
                assert!(e.contains(&format!("disk of rank {r} is full")), "{e}");
            } else {
                assert!(e.contains("writing failed on rank 5 (pp1 dp0 ep0 tp1) (and 1 other rank(s))") && e.contains("disk of rank 5 is full ✗"), "{e}");
            }
        }
        let ok = on_mesh("dp2,tp2", 4, |r, cx| agree(cx, "writing", Ok(r)).unwrap());
        assert_eq!(ok, vec![0, 1, 2, 3]);
    }
}
