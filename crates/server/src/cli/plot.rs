//! SVG charts in the style of the paper's figures (plotters, SVG backend).

use anyhow::{anyhow, Result};
use plotters::prelude::*;
use std::path::Path;

const COLORS: [RGBColor; 4] = [RGBColor(214, 39, 40), RGBColor(31, 119, 180), RGBColor(44, 160, 44), RGBColor(255, 127, 14)];

/// One named line of (x, y) points.
pub struct Series {
    /// Legend label.
    pub name: String,
    /// Points in x order.
    pub points: Vec<(f64, f64)>,
}

fn err<E: std::fmt::Display>(e: E) -> anyhow::Error {
    anyhow!("plotting failed: {e}")
}

/// A line chart with markers; y is clipped at `y_max` like the paper's
/// Fig. 12 (latency explodes past a system's capacity).
pub fn line_chart(path: &Path, title: &str, x_label: &str, y_label: &str, series: &[Series], y_max: f64) -> Result<()> {
    let x_max = series.iter().flat_map(|s| s.points.iter().map(|p| p.0)).fold(0.0f64, f64::max) * 1.05;
    let root = SVGBackend::new(path, (640, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..x_max, 0.0..y_max)
        .map_err(err)?;
    chart.configure_mesh().x_desc(x_label).y_desc(y_label).light_line_style(WHITE.mix(0.0)).draw().map_err(err)?;
    for (i, s) in series.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        let pts: Vec<(f64, f64)> = s.points.iter().map(|&(x, y)| (x, y.min(y_max))).collect();
        chart
            .draw_series(LineSeries::new(pts.clone(), color.stroke_width(2)))
            .map_err(err)?
            .label(s.name.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], color.stroke_width(2)));
        chart.draw_series(pts.iter().map(|&p| Circle::new(p, 3, color.filled()))).map_err(err)?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}

/// Grouped bars: one group per label, one bar per series, values printed
/// on top (the paper's Figs. 13 and 15).
pub fn bar_chart(
    path: &Path,
    title: &str,
    y_label: &str,
    groups: &[String],
    series: &[(String, Vec<f64>)],
    value_fmt: fn(f64) -> String,
) -> Result<()> {
    let y_max = series.iter().flat_map(|s| s.1.iter().copied()).fold(0.0f64, f64::max) * 1.2;
    let n_series = series.len().max(1) as f64;
    let root = SVGBackend::new(path, (640, 420)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(56)
        .build_cartesian_2d(0.0..groups.len() as f64, 0.0..y_max.max(1e-9))
        .map_err(err)?;
    let labels = groups.to_vec();
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(groups.len() * 2 + 1)
        .x_label_formatter(&|x| {
            let i = x.floor() as usize;
            if (x - x.floor() - 0.5).abs() < 0.01 && i < labels.len() {
                labels[i].clone()
            } else {
                String::new()
            }
        })
        .y_desc(y_label)
        .draw()
        .map_err(err)?;
    for (si, (name, values)) in series.iter().enumerate() {
        let color = COLORS[si % COLORS.len()];
        let width = 0.8 / n_series;
        chart
            .draw_series(values.iter().enumerate().map(|(gi, &v)| {
                let x0 = gi as f64 + 0.1 + si as f64 * width;
                Rectangle::new([(x0, 0.0), (x0 + width * 0.95, v)], color.filled())
            }))
            .map_err(err)?
            .label(name.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 12, y + 5)], color.filled()));
        chart
            .draw_series(values.iter().enumerate().map(|(gi, &v)| {
                let x = gi as f64 + 0.1 + si as f64 * width;
                Text::new(value_fmt(v), (x, v + y_max * 0.02), ("sans-serif", 11))
            }))
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)?;
    Ok(())
}
