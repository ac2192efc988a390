//! Line plots written as PNG files: the loss curve at the end of a run.
//!
//! A deliberately small renderer (axes with round-number ticks, labels in
//! an 8×8 bitmap font, one polyline per series, a legend) so that a run can
//! draw its own curve without a font stack or a plotting runtime.

use font8x8::UnicodeFonts;
use std::fs::File;
use std::io::BufWriter;
use std::path::Path;
use tessera_core::{Error, Result};

/// An RGB colour.
pub type Rgb = [u8; 3];

/// One curve of a [`LinePlot`].
#[derive(Clone, Debug)]
pub struct Series {
    /// Its name in the legend.
    pub label: String,
    /// Its colour.
    pub color: Rgb,
    /// Its points, in x order. Non-finite points are left out.
    pub points: Vec<(f64, f64)>,
}

/// A plot of one or more series against shared axes.
#[derive(Clone, Debug)]
pub struct LinePlot {
    /// Title drawn above the axes.
    pub title: String,
    /// Label of the x axis.
    pub x_label: String,
    /// Label of the y axis.
    pub y_label: String,
    /// The curves.
    pub series: Vec<Series>,
}

const WIDTH: usize = 900;
const HEIGHT: usize = 540;
const LEFT: usize = 90;
const RIGHT: usize = 30;
const TOP: usize = 50;
const BOTTOM: usize = 60;
const WHITE: Rgb = [255, 255, 255];
const INK: Rgb = [40, 40, 40];
const GRID: Rgb = [225, 225, 225];

/// Colours for successive series.
pub const PALETTE: [Rgb; 4] = [[31, 119, 180], [214, 39, 40], [44, 160, 44], [148, 103, 189]];

struct Canvas {
    pixels: Vec<u8>,
}

impl Canvas {
    fn new() -> Self {
        Canvas { pixels: WHITE.repeat(WIDTH * HEIGHT) }
    }

    fn set(&mut self, x: i64, y: i64, c: Rgb) {
        if (0..WIDTH as i64).contains(&x) && (0..HEIGHT as i64).contains(&y) {
            let i = 3 * (y as usize * WIDTH + x as usize);
            self.pixels[i..i + 3].copy_from_slice(&c);
        }
    }

    /// A line `width` pixels thick (Bresenham, widened by a square brush).
    fn line(&mut self, (x0, y0): (i64, i64), (x1, y1): (i64, i64), c: Rgb, width: i64) {
        let (dx, dy) = ((x1 - x0).abs(), -(y1 - y0).abs());
        let (sx, sy) = (if x0 < x1 { 1 } else { -1 }, if y0 < y1 { 1 } else { -1 });
        let (mut x, mut y, mut err) = (x0, y0, dx + dy);
        loop {
            for ox in 0..width {
                for oy in 0..width {
                    self.set(x + ox - width / 2, y + oy - width / 2, c);
                }
            }
            if x == x1 && y == y1 {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }

    /// Text in the 8×8 font magnified `scale` times, its top-left at (x, y).
    fn text(&mut self, x: i64, y: i64, s: &str, c: Rgb, scale: i64) {
        for (i, ch) in s.chars().enumerate() {
            let glyph = font8x8::BASIC_FONTS.get(ch).or_else(|| font8x8::BASIC_FONTS.get('?')).unwrap_or([0; 8]);
            for (row, bits) in glyph.iter().enumerate() {
                for col in 0..8 {
                    if bits >> col & 1 == 1 {
                        for oy in 0..scale {
                            for ox in 0..scale {
                                self.set(x + (i as i64 * 8 + col) * scale + ox, y + row as i64 * scale + oy, c);
                            }
                        }
                    }
                }
            }
        }
    }

    /// Text rotated a quarter turn counter-clockwise, reading bottom to top.
    fn text_vertical(&mut self, x: i64, y: i64, s: &str, c: Rgb) {
        for (i, ch) in s.chars().enumerate() {
            let glyph = font8x8::BASIC_FONTS.get(ch).unwrap_or([0; 8]);
            for (row, bits) in glyph.iter().enumerate() {
                for col in 0..8 {
                    if bits >> col & 1 == 1 {
                        self.set(x + row as i64, y - (i as i64 * 8 + col), c);
                    }
                }
            }
        }
    }
}

/// Round-number tick positions covering `lo..=hi`, about `n` of them.
/// The encoder's error as the I/O error it usually wraps (a failed write),
/// or as one that carries it.
fn png_io(e: png::EncodingError) -> std::io::Error {
    match e {
        png::EncodingError::IoError(e) => e,
        e => std::io::Error::other(e),
    }
}

fn ticks(lo: f64, hi: f64, n: usize) -> Vec<f64> {
    let raw = (hi - lo) / n as f64;
    let mag = 10f64.powf(raw.log10().floor());
    let step = [1.0, 2.0, 5.0, 10.0].iter().map(|m| m * mag).find(|s| *s >= raw).unwrap_or(10.0 * mag);
    let mut t = (lo / step).ceil() * step;
    let mut out = Vec::new();
    while t <= hi + step * 1e-9 {
        out.push(t);
        t += step;
    }
    out
}

fn label(v: f64) -> String {
    if v == 0.0 {
        "0".into()
    } else if v.abs() >= 1e4 || v.abs() < 1e-2 {
        format!("{v:.1e}")
    } else if v.fract() == 0.0 {
        format!("{v:.0}")
    } else {
        let s = format!("{v:.3}");
        s.trim_end_matches('0').to_string()
    }
}

impl LinePlot {
    /// Draws the plot into RGB pixels (`WIDTH × HEIGHT`, row-major).
    fn render(&self) -> Result<Canvas> {
        let points: Vec<(f64, f64)> = self.series.iter().flat_map(|s| s.points.iter().copied()).filter(|(x, y)| x.is_finite() && y.is_finite()).collect();
        if points.is_empty() {
            return Err(Error::InvalidArgument { op: "LinePlot", detail: "no finite points to plot; give at least one series a point".into() });
        }
        let (mut x0, mut x1) = points.iter().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.0), b.max(p.0)));
        let (mut y0, mut y1) = points.iter().fold((f64::MAX, f64::MIN), |(a, b), p| (a.min(p.1), b.max(p.1)));
        if x1 <= x0 {
            x1 = x0 + 1.0;
        }
        if y1 <= y0 {
            (y0, y1) = (y0 - 0.5, y1 + 0.5);
        }
        let pad = 0.04 * (y1 - y0);
        (y0, y1) = (y0 - pad, y1 + pad);
        x0 = x0.min(x1);
        let (pw, ph) = ((WIDTH - LEFT - RIGHT) as f64, (HEIGHT - TOP - BOTTOM) as f64);
        let px = |x: f64| LEFT as i64 + ((x - x0) / (x1 - x0) * pw).round() as i64;
        let py = |y: f64| (TOP as f64 + ph - (y - y0) / (y1 - y0) * ph).round() as i64;

        let mut c = Canvas::new();
        let (left, right, top, bottom) = (LEFT as i64, (WIDTH - RIGHT) as i64, TOP as i64, (HEIGHT - BOTTOM) as i64);
        for t in ticks(y0, y1, 6) {
            c.line((left, py(t)), (right, py(t)), GRID, 1);
            let s = label(t);
            c.text(left - 8 - 8 * s.len() as i64, py(t) - 4, &s, INK, 1);
        }
        for t in ticks(x0, x1, 8) {
            c.line((px(t), top), (px(t), bottom), GRID, 1);
            let s = label(t);
            c.text(px(t) - 4 * s.len() as i64, bottom + 8, &s, INK, 1);
        }
        c.line((left, top), (left, bottom), INK, 1);
        c.line((left, bottom), (right, bottom), INK, 1);
        c.text(WIDTH as i64 / 2 - 8 * self.title.len() as i64, 14, &self.title, INK, 2);
        c.text(WIDTH as i64 / 2 - 4 * self.x_label.len() as i64, HEIGHT as i64 - 24, &self.x_label, INK, 1);
        c.text_vertical(14, HEIGHT as i64 / 2 + 4 * self.y_label.len() as i64, &self.y_label, INK);
        for s in &self.series {
            let pts: Vec<(i64, i64)> = s.points.iter().filter(|(x, y)| x.is_finite() && y.is_finite()).map(|&(x, y)| (px(x), py(y))).collect();
            match pts.as_slice() {
                [p] => c.line(*p, *p, s.color, 4),
                _ => pts.windows(2).for_each(|w| c.line(w[0], w[1], s.color, 2)),
            }
        }
        for (i, s) in self.series.iter().enumerate() {
            let y = top + 10 + 16 * i as i64;
            c.line((right - 190, y + 4), (right - 166, y + 4), s.color, 3);
            c.text(right - 158, y, &s.label, INK, 1);
        }
        Ok(c)
    }

    /// Writes the plot as a PNG file.
    pub fn write_png(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let canvas = self.render()?;
        let file = File::create(path).map_err(|e| Error::io(path, e))?;
        let mut encoder = png::Encoder::new(BufWriter::new(file), WIDTH as u32, HEIGHT as u32);
        encoder.set_color(png::ColorType::Rgb);
        encoder.set_depth(png::BitDepth::Eight);
        let mut writer = encoder.write_header().map_err(|e| Error::io(path, png_io(e)))?;
        writer.write_image_data(&canvas.pixels).map_err(|e| Error::io(path, png_io(e)))?;
        writer.finish().map_err(|e| Error::io(path, png_io(e)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ticks_are_round_and_cover_the_range() {
        assert_eq!(ticks(0.0, 10.0, 5), vec![0.0, 2.0, 4.0, 6.0, 8.0, 10.0]);
        let t = ticks(0.13, 0.87, 6);
        assert!(t.iter().all(|v| (0.13..=0.87).contains(v)));
        assert!((t[1] - t[0] - 0.2).abs() < 1e-12, "{t:?}");
    }

    #[test]
    fn a_curve_leaves_ink_where_its_points_are() {
        let plot = LinePlot {
            title: "loss".into(),
            x_label: "step".into(),
            y_label: "loss".into(),
            series: vec![Series { label: "train".into(), color: PALETTE[0], points: vec![(0.0, 4.0), (100.0, 1.0)] }],
        };
        let c = plot.render().unwrap();
        let colored = c.pixels.chunks(3).filter(|p| *p == PALETTE[0]).count();
        // The legend swatch is 25 × 3 pixels; a diagonal across the plot is far longer.
        assert!(colored > 1000, "{colored} pixels of the series colour");
        let empty = LinePlot { series: vec![], ..plot };
        assert!(empty.render().is_err());
    }
}
