"""Plot parts that know no colours of their own, below the theme (which uses them): a title that
wraps instead of widening its plot (`title`), legend glyphs that look like what they stand for
(`legend`). The panels' own plot parts, which paint in the theme's colours, are in `ui.panels`
(`plot_marks`). Main thread only."""
