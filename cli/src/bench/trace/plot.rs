//! The replay's SVG, drawn by hand as `bench agent` draws its own: hit share per minute of
//! trace time against the ideal and the simulated LRU (left), and the TTFT CDF (right).

use std::fmt::Write;

const COLORS: [&str; 6] = [
    "#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b",
];

/// `text` with the characters XML gives a meaning escaped (labels and paths come from the
/// user).
fn escape(text: &str) -> String {
    text.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

/// A plot area and its data ranges.
struct Panel {
    x0: f64,
    y0: f64,
    w: f64,
    h: f64,
    xmax: f64,
    ymax: f64,
}

impl Panel {
    fn x(&self, v: f64) -> f64 {
        self.x0 + self.w * (v / self.xmax).clamp(0.0, 1.0)
    }

    fn y(&self, v: f64) -> f64 {
        self.y0 + self.h - self.h * (v / self.ymax).clamp(0.0, 1.0)
    }

    /// Axes, four ticks a side, the title and the axis labels.
    fn frame(&self, s: &mut String, title: &str, xlabel: &str, xfmt: &dyn Fn(f64) -> String) {
        let (l, b, r) = (self.x0, self.y0 + self.h, self.x0 + self.w);
        let _ = write!(
            s,
            "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\" font-size=\"13\">{}</text>\n\
             <line x1=\"{l}\" y1=\"{b}\" x2=\"{r}\" y2=\"{b}\" stroke=\"black\"/>\n\
             <line x1=\"{l}\" y1=\"{}\" x2=\"{l}\" y2=\"{b}\" stroke=\"black\"/>\n\
             <text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{xlabel}</text>\n",
            l + self.w / 2.0,
            self.y0 - 10.0,
            escape(title),
            self.y0,
            l + self.w / 2.0,
            b + 34.0
        );
        for k in 0..=4 {
            let f = k as f64 / 4.0;
            let _ = write!(
                s,
                "<text x=\"{}\" y=\"{}\" text-anchor=\"end\">{:.*}%</text>\n\
                 <text x=\"{}\" y=\"{}\" text-anchor=\"middle\">{}</text>\n",
                l - 6.0,
                self.y(f * self.ymax) + 4.0,
                if self.ymax < 0.2 { 1 } else { 0 },
                100.0 * f * self.ymax,
                self.x(f * self.xmax),
                b + 16.0,
                xfmt(f * self.xmax)
            );
        }
    }

    fn line(&self, s: &mut String, points: &[(f64, f64)], color: &str, dash: bool) {
        let pts: Vec<String> = points
            .iter()
            .filter(|(x, y)| x.is_finite() && y.is_finite())
            .map(|&(x, y)| format!("{:.1},{:.1}", self.x(x), self.y(y)))
            .collect();
        let _ = writeln!(
            s,
            "<polyline fill=\"none\" stroke=\"{color}\" stroke-width=\"2\"{} points=\"{}\"/>",
            if dash {
                " stroke-dasharray=\"6 4\""
            } else {
                ""
            },
            pts.join(" ")
        );
        // A lone point draws no line: mark it.
        if let [p] = pts.as_slice() {
            let (x, y) = p.split_once(',').unwrap_or(("0", "0"));
            let _ = writeln!(
                s,
                "<circle cx=\"{x}\" cy=\"{y}\" r=\"3\" fill=\"{color}\"/>"
            );
        }
    }

    fn legend(&self, s: &mut String, items: &[(String, &str)]) {
        for (k, (name, color)) in items.iter().enumerate() {
            let ly = self.y0 + 14.0 + 16.0 * k as f64;
            let _ = writeln!(
                s,
                "<rect x=\"{}\" y=\"{}\" width=\"12\" height=\"4\" fill=\"{color}\"/>\
                 <text x=\"{}\" y=\"{}\">{}</text>",
                self.x0 + 10.0,
                ly - 4.0,
                self.x0 + 28.0,
                ly,
                escape(name)
            );
        }
    }
}

/// One series of hit shares per minute (`None`: no value that minute).
pub struct Series {
    /// Legend text.
    pub name: String,
    /// One value per minute.
    pub per_minute: Vec<Option<f64>>,
    /// Drawn dashed (the simulated references).
    pub dashed: bool,
}

/// The whole figure: `shares` per minute on the left, the TTFT CDF of each named sample of
/// seconds on the right.
pub fn svg(title: &str, shares: &[Series], ttfts: &[(String, Vec<f64>)]) -> String {
    let (w, h) = (1000.0, 430.0);
    let mut s = format!(
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{w}\" height=\"{h}\" \
         font-family=\"sans-serif\" font-size=\"12\">\n\
         <rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n\
         <text x=\"{}\" y=\"20\" text-anchor=\"middle\" font-size=\"14\">{}</text>\n",
        w / 2.0,
        escape(title)
    );
    let minutes = shares.iter().map(|x| x.per_minute.len()).max().unwrap_or(1);
    let top = shares
        .iter()
        .flat_map(|x| x.per_minute.iter().flatten())
        .fold(0.0f64, |a, &b| a.max(b));
    let left = Panel {
        x0: 60.0,
        y0: 60.0,
        w: 390.0,
        h: 300.0,
        xmax: (minutes.max(2) - 1) as f64,
        ymax: ((top * 10.0).ceil() / 10.0).clamp(0.1, 1.0),
    };
    left.frame(
        &mut s,
        "hit share of prompt tokens per minute",
        "minute of trace time",
        &|v| format!("{v:.*}", if minutes > 5 { 0 } else { 1 }),
    );
    let mut legend = Vec::new();
    for (k, x) in shares.iter().enumerate() {
        let color = COLORS[k % COLORS.len()];
        let pts: Vec<(f64, f64)> = x
            .per_minute
            .iter()
            .enumerate()
            .filter_map(|(m, v)| v.map(|v| (m as f64, v)))
            .collect();
        left.line(&mut s, &pts, color, x.dashed);
        legend.push((x.name.clone(), color));
    }
    left.legend(&mut s, &legend);
    let tmax = ttfts
        .iter()
        .flat_map(|(_, v)| v.iter())
        .copied()
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max)
        .max(1e-3);
    let right = Panel {
        x0: 560.0,
        y0: 60.0,
        w: 390.0,
        h: 300.0,
        xmax: tmax,
        ymax: 1.0,
    };
    right.frame(&mut s, "TTFT CDF", "seconds", &|v| format!("{v:.2}"));
    let mut legend = Vec::new();
    for (k, (name, v)) in ttfts.iter().enumerate() {
        let color = COLORS[k % COLORS.len()];
        let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
        v.sort_by(f64::total_cmp);
        let n = v.len() as f64;
        let pts: Vec<(f64, f64)> = v
            .iter()
            .enumerate()
            .map(|(i, &t)| (t, (i + 1) as f64 / n))
            .collect();
        right.line(&mut s, &pts, color, false);
        legend.push((format!("{name} ({} requests)", v.len()), color));
    }
    right.legend(&mut s, &legend);
    s + "</svg>\n"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_every_series_and_skips_missing_minutes() {
        let shares = [
            Series {
                name: "kvstore".into(),
                per_minute: vec![Some(0.1), None, Some(0.3)],
                dashed: false,
            },
            Series {
                name: "ideal".into(),
                per_minute: vec![Some(0.2), Some(0.2), Some(0.4)],
                dashed: true,
            },
        ];
        let out = svg(
            "a <b> & \"c\"",
            &shares,
            &[("run".into(), vec![0.5, 1.0, 2.0])],
        );
        assert!(out.contains(">a &lt;b&gt; &amp; &quot;c&quot;<"), "{out}");
        assert_eq!(out.matches("<polyline").count(), 3);
        assert_eq!(out.matches("stroke-dasharray").count(), 1);
        assert!(out.contains(">kvstore<") && out.contains(">ideal<"));
        assert!(out.contains("run (3 requests)"));
        // Minute 1 of the first series is absent: two points, not three.
        let first = out.split("<polyline").nth(1).unwrap();
        let pts = first
            .split("points=\"")
            .nth(1)
            .unwrap()
            .split('"')
            .next()
            .unwrap();
        assert_eq!(pts.split(' ').count(), 2);
    }
}
