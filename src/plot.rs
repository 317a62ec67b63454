//! Pictures of a plan's memory (`memplan plot`), drawn as SVG with plotters.
//!
//! One picture, three panels:
//! - top left: live bytes at every step of the graph's **program order**
//!   (no reuse), stacked by tensor role;
//! - top right: the same for **memplan's order** (with the reuses it takes),
//!   on the same byte scale, so the two heights compare at a glance; the
//!   lower bound is a dashed line across both;
//! - bottom: memplan's **arena layout**: every tensor a rectangle spanning
//!   its live steps (x) and its bytes in the arena (y), coloured by role.
//!
//! Curves come from [`Timeline`]. Graphs with more steps than pixels are
//! drawn bucket by bucket, each bucket showing its highest step, so the
//! peak is drawn exactly. Layout rectangles too small to see (under a tenth
//! of a pixel in both directions) are left out to keep the file small.

use plotters::coord::Shift;
use plotters::prelude::*;

use crate::error::Error;
use crate::graph::{Graph, Role};
use crate::plan::Plan;
use crate::timeline::Timeline;

use crate::timeline::format_in;
pub use crate::timeline::{STACK_ORDER, byte_unit, human, role_label};

/// A role's colour (Okabe–Ito, readable with colour-blindness).
pub fn role_color(role: Role) -> RGBColor {
    match role {
        Role::Parameter => RGBColor(0x00, 0x72, 0xB2),
        Role::OptimizerState => RGBColor(0x56, 0xB4, 0xE9),
        Role::Gradient => RGBColor(0xE6, 0x9F, 0x00),
        Role::Activation => RGBColor(0x00, 0x9E, 0x73),
        Role::Temporary => RGBColor(0xF0, 0xE4, 0x42),
        Role::Communication => RGBColor(0xD5, 0x5E, 0x00),
        Role::Input => RGBColor(0xCC, 0x79, 0xA7),
        Role::Output => RGBColor(0x99, 0x99, 0x99),
    }
}

/// What to draw and how big.
#[derive(Clone, Debug)]
pub struct PlotOptions {
    /// Picture size in pixels.
    pub width: u32,
    pub height: u32,
    /// Title; the graph's name and size when `None`.
    pub title: Option<String>,
    /// The lower bound to draw, with its kind; the plan's when `None`.
    pub lower_bound: Option<(u64, String)>,
}

impl Default for PlotOptions {
    fn default() -> Self {
        PlotOptions {
            width: 1200,
            height: 900,
            title: None,
            lower_bound: None,
        }
    }
}

fn draw_err<E: std::error::Error + Send + Sync>(e: DrawingAreaErrorKind<E>) -> Error {
    Error::Internal(format!("drawing the picture failed: {e}"))
}

/// Draws the picture of `plan` for `g` and returns the SVG text.
pub fn svg(g: &Graph, plan: &Plan, opts: &PlotOptions) -> Result<String, Error> {
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (opts.width, opts.height)).into_drawing_area();
        draw(&root, g, plan, opts).map_err(draw_err)?;
        root.present().map_err(draw_err)?;
    }
    // Both are SVG's defaults; dropping them makes the file a sixth smaller.
    Ok(out
        .replace(" opacity=\"1\"", "")
        .replace(" stroke=\"none\"", ""))
}

type DrawResult<E> = Result<(), DrawingAreaErrorKind<E>>;

fn draw<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    g: &Graph,
    plan: &Plan,
    opts: &PlotOptions,
) -> DrawResult<DB::ErrorType> {
    root.fill(&WHITE)?;
    let program = Timeline::program_order(g);
    let memplan = Timeline::of_plan(g, plan);
    let (bound, bound_kind) = opts.lower_bound.clone().unwrap_or_else(|| {
        (
            plan.stats.lower_bound_bytes,
            plan.stats.lower_bound_kind.clone(),
        )
    });

    let title = opts.title.clone().unwrap_or_else(|| {
        format!(
            "{}: {} ops, {} tensors: memory over one training step",
            g.name,
            g.num_ops(),
            g.num_tensors()
        )
    });
    let h = opts.height as i32;
    let (top, rest) = root.split_vertically(40);
    top.draw_text(
        &title,
        &("sans-serif", 22).into_font().color(&BLACK),
        (16, 10),
    )?;
    let mut roles: Vec<Role> = STACK_ORDER
        .iter()
        .copied()
        .filter(|r| program.roles_present().contains(r) || memplan.roles_present().contains(r))
        .collect();
    if roles.is_empty() {
        roles.push(Role::Activation);
    }
    let bound_label = match (bound, bound_kind.is_empty()) {
        (0, _) => None,
        (b, true) => Some(format!("lower bound {}", human(b))),
        (b, false) => Some(format!("lower bound {} ({bound_kind})", human(b))),
    };
    let mut entries: Vec<(Key, String)> = roles
        .iter()
        .map(|&r| (Key::Swatch(role_color(r)), role_label(r).to_string()))
        .collect();
    if let Some(b) = bound_label {
        entries.push((Key::Dashed, b));
    }
    entries.push((Key::Line(OVERLAY), "program order's total".into()));
    if memplan.host_peak > 0 || program.host_peak > 0 {
        entries.push((
            Key::Line(HOST),
            "host pool (offloaded copies; not in the device curves)".into(),
        ));
    }
    let entries = legend_layout(entries, opts.width as i32);
    let legend_h = entries.last().map_or(0, |e| e.2.1) + 28;
    let (legend, rest) = rest.split_vertically(legend_h);
    draw_legend(&legend, &entries)?;

    let curves_h = ((h - 40 - legend_h) as f64 * 0.52) as i32;
    let (curves, layout) = rest.split_vertically(curves_h);
    let (left, right) = curves.split_horizontally(opts.width as i32 / 2);
    let top = program
        .peak
        .max(memplan.peak)
        .max(bound)
        .max(program.host_peak)
        .max(memplan.host_peak)
        .max(1) as f64;
    let host = |tl: &Timeline| match tl.host_peak {
        0 => String::new(),
        b => format!(", host {}", human(b)),
    };
    let unit = byte_unit(top);
    // Axes run in the unit (GiB, ...) so their ticks fall on round values.
    let ymax = top * 1.1 / unit.1;
    let saving = 1.0 - memplan.peak as f64 / program.peak.max(1) as f64;
    draw_curve(
        &left,
        &program,
        None,
        &roles,
        ymax,
        unit,
        bound,
        &format!(
            "program order, no reuse: peak {}{}",
            human(program.peak),
            host(&program)
        ),
    )?;
    draw_curve(
        &right,
        &memplan,
        Some(&program),
        &roles,
        ymax,
        unit,
        bound,
        &format!(
            "memplan order: peak {} ({:+.1}%){}",
            human(memplan.peak),
            -100.0 * saving,
            host(&memplan)
        ),
    )?;
    draw_layout(&layout, g, plan, &memplan)?;
    Ok(())
}

/// One legend entry: what its key looks like, and its text.
enum Key {
    Swatch(RGBColor),
    Dashed,
    Line(RGBColor),
}

/// Legend entries placed left to right, wrapping at `width`: each entry's
/// key, text and top-left corner.
fn legend_layout(entries: Vec<(Key, String)>, width: i32) -> Vec<(Key, String, (i32, i32))> {
    const ROW: i32 = 24;
    let (mut x, mut y) = (70, 6);
    let mut out = Vec::new();
    for (key, label) in entries {
        // The naive font metrics of plotters' SVG backend: about 7.5 px per
        // character at 15 px.
        let w = 34 + (7.5 * label.len() as f64) as i32 + 20;
        if x + w > width - 10 && x > 70 {
            x = 70;
            y += ROW;
        }
        out.push((key, label, (x, y)));
        x += w;
    }
    out
}

fn draw_legend<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    entries: &[(Key, String, (i32, i32))],
) -> DrawResult<DB::ErrorType> {
    let font = ("sans-serif", 15).into_font().color(&BLACK);
    for (key, label, (x, y)) in entries {
        let (x, y) = (*x, *y);
        match key {
            Key::Swatch(c) => area.draw(&Rectangle::new([(x, y), (x + 26, y + 16)], c.filled()))?,
            Key::Dashed => {
                for i in 0..3 {
                    let x0 = x + i * 10;
                    area.draw(&PathElement::new(
                        vec![(x0, y + 8), (x0 + 6, y + 8)],
                        BLACK.stroke_width(2),
                    ))?;
                }
            }
            Key::Line(c) => area.draw(&PathElement::new(
                vec![(x, y + 8), (x + 26, y + 8)],
                c.stroke_width(2),
            ))?,
        }
        area.draw_text(label, &font, (x + 34, y + 1))?;
    }
    Ok(())
}

/// `(x0, x1, step)` buckets covering `0..n`: one per step when `n` fits in
/// `max_buckets`, else `max_buckets` runs of steps, each represented by its
/// step with the most live bytes.
fn buckets(total: &[u64], max_buckets: usize) -> Vec<(usize, usize, usize)> {
    let n = total.len();
    let b = n.min(max_buckets.max(1));
    (0..b)
        .filter_map(|k| {
            let (x0, x1) = (k * n / b, (k + 1) * n / b);
            let rep = (x0..x1).max_by_key(|&i| (total[i], std::cmp::Reverse(i)))?;
            Some((x0, x1, rep))
        })
        .collect()
}

/// The colour of the program order's total drawn over memplan's curve.
const OVERLAY: RGBColor = RGBColor(0x20, 0x20, 0x20);
/// The host pool's line.
const HOST: RGBColor = RGBColor(0x00, 0x7a, 0x87);

/// One stacked live-bytes panel; `overlay`'s total is drawn as a line.
/// The outline of a step function: `values[k]` over bucket `k`, scaled,
/// without the points inside flat runs.
fn steps(bk: &[(usize, usize, usize)], values: &[u64], scale: f64) -> Vec<(f64, f64)> {
    let mut pts: Vec<(f64, f64)> = Vec::new();
    for (k, (&(x0, x1, _), &v)) in bk.iter().zip(values).enumerate() {
        let y = v as f64 / scale;
        if k == 0 || values[k - 1] != v {
            pts.push((x0 as f64, y));
        }
        if k + 1 == bk.len() || values[k + 1] != v {
            pts.push((x1 as f64, y));
        }
    }
    pts
}

#[allow(clippy::too_many_arguments)]
fn draw_curve<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    tl: &Timeline,
    overlay: Option<&Timeline>,
    roles: &[Role],
    ymax: f64,
    (unit, scale): (&'static str, f64),
    bound: u64,
    caption: &str,
) -> DrawResult<DB::ErrorType> {
    let n = tl.steps.max(1) as f64;
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 17))
        .margin(10)
        .margin_right(24)
        .x_label_area_size(40)
        .y_label_area_size(76)
        .build_cartesian_2d(0f64..n, 0f64..ymax)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .light_line_style(WHITE.mix(0.0))
        .bold_line_style(BLACK.mix(0.12))
        .x_desc("step (position in the order)")
        .y_desc("live bytes")
        .x_labels(6)
        .y_labels(8)
        .x_label_formatter(&|v| format!("{}", *v as u64))
        .y_label_formatter(&|v| format_in(*v, unit, 1.0))
        .axis_desc_style(("sans-serif", 15))
        .label_style(("sans-serif", 13))
        .draw()?;

    let px = (area.dim_in_pixel().0 as usize).saturating_sub(100).max(50);
    let bk = buckets(&tl.total, px);
    let mut below = vec![0u64; bk.len()];
    for &r in roles {
        let curve = tl.role(r);
        if curve.iter().all(|&b| b == 0) {
            continue;
        }
        let above: Vec<u64> = bk
            .iter()
            .zip(&below)
            .map(|(&(_, _, s), &lo)| lo + curve[s])
            .collect();
        let mut pts = steps(&bk, &above, scale);
        let mut lower = steps(&bk, &below, scale);
        lower.reverse();
        pts.extend(lower);
        chart.draw_series(std::iter::once(Polygon::new(pts, role_color(r).filled())))?;
        below = above;
    }
    if let Some(o) = overlay {
        let ob = buckets(&o.total, px);
        let values: Vec<u64> = ob.iter().map(|&(_, _, s)| o.total[s]).collect();
        let pts = steps(&ob, &values, scale);
        chart.draw_series(LineSeries::new(pts, OVERLAY.stroke_width(1)))?;
    }
    // The host pool of a step with offload, as a line over the device's areas.
    if tl.host_peak > 0 {
        let hb = buckets(&tl.host, px);
        let values: Vec<u64> = hb.iter().map(|&(_, _, s)| tl.host[s]).collect();
        let pts = steps(&hb, &values, scale);
        chart.draw_series(LineSeries::new(pts, HOST.stroke_width(2)))?;
    }
    // The peak, marked where it happens.
    let ps = tl.peak_step() as f64 + 0.5;
    chart.draw_series(std::iter::once(Circle::new(
        (ps, tl.peak as f64 / scale),
        4,
        BLACK.filled(),
    )))?;
    if bound > 0 {
        let b = bound as f64 / scale;
        chart.draw_series(DashedLineSeries::new(
            vec![(0.0, b), (n, b)],
            8,
            5,
            BLACK.stroke_width(2),
        ))?;
    }
    Ok(())
}

fn draw_layout<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    g: &Graph,
    plan: &Plan,
    tl: &Timeline,
) -> DrawResult<DB::ErrorType> {
    let n = tl.steps.max(1) as f64;
    let (unit, scale) = byte_unit(plan.arena_bytes.max(1) as f64);
    let arena = plan.arena_bytes.max(1) as f64 / scale;
    let caption = format!(
        "memplan arena layout: {} arena, {} max live (order: {}, offsets: {})",
        human(plan.arena_bytes),
        human(tl.peak),
        plan.stats.order_source,
        plan.stats.layout_source
    );
    let mut chart = ChartBuilder::on(area)
        .caption(caption, ("sans-serif", 17))
        .margin(10)
        .margin_right(24)
        .x_label_area_size(40)
        .y_label_area_size(76)
        .build_cartesian_2d(0f64..n, 0f64..arena)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .disable_y_mesh()
        .x_desc("step (position in memplan's order)")
        .y_desc("offset in the arena")
        .x_labels(12)
        .y_labels(8)
        .x_label_formatter(&|v| format!("{}", *v as u64))
        .y_label_formatter(&|v| format_in(*v, unit, 1.0))
        .axis_desc_style(("sans-serif", 15))
        .label_style(("sans-serif", 13))
        .draw()?;
    let (pw, ph) = chart.plotting_area().dim_in_pixel();
    let (sx, sy) = (pw as f64 / n, ph as f64 / arena);
    let mut rects = Vec::new();
    for t in g.tensor_ids() {
        let (Some(iv), Some(off)) = (tl.intervals[t.index()], plan.offsets[t.index()]) else {
            continue;
        };
        let x = g.tensor(t);
        let (x0, x1) = (iv.first as f64, iv.last as f64 + 1.0);
        let (y0, y1) = (off as f64 / scale, (off + x.size) as f64 / scale);
        if (x1 - x0) * sx < 0.1 && (y1 - y0) * sy < 0.1 {
            continue;
        }
        rects.push(Rectangle::new(
            [(x0, y0), (x1, y1)],
            role_color(x.role).filled(),
        ));
    }
    chart.draw_series(rects)?;
    Ok(())
}

/// The budget / added-cost curve of `memplan fit --pareto` as SVG: the
/// fitted arena against the added FLOPs (percent of the step), one point
/// per budget that fits.
pub fn pareto_svg(title: &str, points: &[(u64, f64)], floor: u64) -> Result<String, Error> {
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (900, 600)).into_drawing_area();
        draw_pareto(&root, title, points, floor).map_err(draw_err)?;
        root.present().map_err(draw_err)?;
    }
    Ok(out)
}

fn draw_pareto<DB: DrawingBackend>(
    root: &DrawingArea<DB, Shift>,
    title: &str,
    points: &[(u64, f64)],
    floor: u64,
) -> DrawResult<DB::ErrorType> {
    root.fill(&WHITE)?;
    let xmax = points.iter().map(|p| p.0).max().unwrap_or(1).max(floor) as f64 * 1.05;
    let xmin = floor as f64 * 0.95;
    let ymax = points.iter().map(|p| p.1).fold(1.0, f64::max) * 1.15;
    let (unit, scale) = crate::timeline::byte_unit(xmax);
    let mut chart = ChartBuilder::on(root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(44)
        .y_label_area_size(64)
        .build_cartesian_2d(xmin..xmax, 0f64..ymax)?;
    chart
        .configure_mesh()
        .x_desc(format!("planned arena ({unit})"))
        .y_desc("added FLOPs (% of the step)")
        .x_label_formatter(&|v| format!("{:.2}", v / scale))
        .y_label_formatter(&|v| format!("{v:.1}"))
        .draw()?;
    let pts: Vec<(f64, f64)> = points.iter().map(|&(a, c)| (a as f64, c)).collect();
    chart.draw_series(LineSeries::new(pts.clone(), BLUE.stroke_width(2)))?;
    chart.draw_series(pts.iter().map(|&p| Circle::new(p, 4, BLUE.filled())))?;
    chart.draw_series(DashedLineSeries::new(
        vec![(floor as f64, 0.0), (floor as f64, ymax)],
        6,
        4,
        RED.stroke_width(1),
    ))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn units_read_well() {
        assert_eq!(human(0), "0 B");
        assert_eq!(human(512), "512 B");
        assert_eq!(human(1536), "1.5 KiB");
        assert_eq!(human(3 << 29), "1.5 GiB");
        assert_eq!(human(1 << 20), "1 MiB");
        assert_eq!(byte_unit(5e9).0, "GiB");
    }

    #[test]
    fn step_outlines_drop_flat_runs() {
        let bk = [(0, 1, 0), (1, 2, 1), (2, 3, 2), (3, 4, 3)];
        let pts = steps(&bk, &[5, 5, 7, 7], 1.0);
        assert_eq!(pts, vec![(0.0, 5.0), (2.0, 5.0), (2.0, 7.0), (4.0, 7.0)]);
    }

    #[test]
    fn buckets_keep_the_peak() {
        let total = [1, 5, 2, 9, 3, 3, 7];
        assert_eq!(buckets(&total, 10).len(), 7);
        let b = buckets(&total, 3);
        assert_eq!(b, vec![(0, 2, 1), (2, 4, 3), (4, 7, 6)]);
        assert!(b.iter().any(|&(_, _, s)| total[s] == 9));
    }

    #[test]
    fn draws_every_panel() {
        let g = crate::models::example("gpt2-tiny", &Default::default()).unwrap();
        let plan = crate::plan(&g, &crate::Options::default()).unwrap();
        let svg = svg(&g, &plan, &PlotOptions::default()).unwrap();
        assert!(svg.starts_with("<svg"));
        for text in [
            "program order, no reuse: peak",
            "memplan order: peak",
            "memplan arena layout",
            "lower bound",
            "activations",
            "optimizer state",
        ] {
            assert!(svg.contains(text), "missing {text:?}");
        }
        // Every role colour in use shows up.
        assert!(svg.to_uppercase().contains("#009E73"));
    }
}
