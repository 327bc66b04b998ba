package benchrun

import (
	"bytes"
	"fmt"
	"image"
	"image/color"
	"image/png"
	"math"
	"slices"
	"strings"
)

// The lateness chart is drawn with the standard library only (a CDF on a
// log axis needs lines, a grid and a few labels, not a plotting library).

// series is one line of the chart.
type series struct {
	name string
	xs   []float64 // lateness in ms
	col  color.RGBA
}

var palette = []color.RGBA{{0x1f, 0x77, 0xb4, 0xff}, {0xd6, 0x27, 0x28, 0xff}, {0x2c, 0xa0, 0x2c, 0xff}, {0xff, 0x7f, 0x0e, 0xff}}

// latencyCDF draws the cumulative distribution of each series: x is the
// lateness in ms on a log scale (values under the left edge are drawn at
// it), y the fraction of messages delivered at most that late.
func latencyCDF(ss []series) ([]byte, error) {
	const w, h, left, right, top, bottom = 900, 560, 70, 30, 30, 70
	img := image.NewRGBA(image.Rect(0, 0, w, h))
	fill(img, img.Bounds(), color.RGBA{0xff, 0xff, 0xff, 0xff})
	maxX := 1.0
	for _, s := range ss {
		for _, x := range s.xs {
			maxX = math.Max(maxX, x)
		}
	}
	lo, hi := -1.0, math.Ceil(math.Log10(maxX)) // 0.1 ms .. next decade
	if hi <= lo {
		hi = lo + 1
	}
	pw, ph := float64(w-left-right), float64(h-top-bottom)
	px := func(ms float64) int {
		l := math.Log10(math.Max(ms, math.Pow(10, lo)))
		return left + int((l-lo)/(hi-lo)*pw)
	}
	py := func(frac float64) int { return top + int((1-frac)*ph) }
	grid := color.RGBA{0xdd, 0xdd, 0xdd, 0xff}
	ink := color.RGBA{0x33, 0x33, 0x33, 0xff}
	for d := lo; d <= hi; d++ {
		for _, m := range []float64{1, 2, 5} {
			v := m * math.Pow(10, d)
			if math.Log10(v) > hi+1e-9 {
				break
			}
			x := px(v)
			vline(img, x, top, h-bottom, grid)
			if m == 1 {
				label(img, x-textWidth(fmtMs(v))/2, h-bottom+10, fmtMs(v), ink)
			}
		}
	}
	for i := 0; i <= 10; i++ {
		y := py(float64(i) / 10)
		hline(img, left, w-right, y, grid)
		label(img, left-textWidth(fmt.Sprintf("%d%%", i*10))-8, y-5, fmt.Sprintf("%d%%", i*10), ink)
	}
	p99 := py(0.99)
	for x := left; x < w-right; x += 6 {
		hline(img, x, x+3, p99, color.RGBA{0x99, 0x99, 0x99, 0xff})
	}
	label(img, w-right-textWidth("p99")-2, p99-14, "p99", ink)
	hline(img, left, w-right, h-bottom, ink)
	vline(img, left, top, h-bottom, ink)
	label(img, left+int(pw)/2-textWidth("lateness ms")/2, h-bottom+34, "lateness ms", ink)

	for i, s := range ss {
		xs := slices.Clone(s.xs)
		slices.Sort(xs)
		if len(xs) == 0 {
			continue
		}
		prevX, prevY := px(xs[0]), py(0)
		for j, x := range xs {
			cx, cy := px(x), py(float64(j+1)/float64(len(xs)))
			line(img, prevX, prevY, cx, prevY, s.col)
			line(img, cx, prevY, cx, cy, s.col)
			prevX, prevY = cx, cy
		}
		ly := top + 10 + i*18
		for t := 0; t < 3; t++ {
			hline(img, left+14, left+40, ly+4+t, s.col)
		}
		label(img, left+48, ly, s.name, ink)
	}
	var buf bytes.Buffer
	if err := png.Encode(&buf, img); err != nil {
		return nil, fmt.Errorf("benchrun: chart: %w", err)
	}
	return buf.Bytes(), nil
}

func fmtMs(v float64) string {
	if v < 1 {
		return strings.TrimRight(strings.TrimRight(fmt.Sprintf("%.1f", v), "0"), ".")
	}
	return fmt.Sprintf("%.0f", v)
}

func fill(img *image.RGBA, r image.Rectangle, c color.RGBA) {
	for y := r.Min.Y; y < r.Max.Y; y++ {
		for x := r.Min.X; x < r.Max.X; x++ {
			img.SetRGBA(x, y, c)
		}
	}
}

func hline(img *image.RGBA, x0, x1, y int, c color.RGBA) {
	for x := x0; x <= x1; x++ {
		img.SetRGBA(x, y, c)
	}
}

func vline(img *image.RGBA, x, y0, y1 int, c color.RGBA) {
	for y := y0; y <= y1; y++ {
		img.SetRGBA(x, y, c)
	}
}

// line draws a 2 px axis-parallel segment (the CDF is a staircase).
func line(img *image.RGBA, x0, y0, x1, y1 int, c color.RGBA) {
	if y0 == y1 {
		hline(img, min(x0, x1), max(x0, x1), y0, c)
		hline(img, min(x0, x1), max(x0, x1), y0+1, c)
		return
	}
	vline(img, x0, min(y0, y1), max(y0, y1), c)
	vline(img, x0+1, min(y0, y1), max(y0, y1), c)
}

// glyphs is a 3x5 pixel font for the few characters the chart writes.
var glyphs = map[rune][5]string{
	'0': {"###", "#.#", "#.#", "#.#", "###"}, '1': {".#.", "##.", ".#.", ".#.", "###"},
	'2': {"###", "..#", "###", "#..", "###"}, '3': {"###", "..#", "###", "..#", "###"},
	'4': {"#.#", "#.#", "###", "..#", "..#"}, '5': {"###", "#..", "###", "..#", "###"},
	'6': {"###", "#..", "###", "#.#", "###"}, '7': {"###", "..#", "..#", "..#", "..#"},
	'8': {"###", "#.#", "###", "#.#", "###"}, '9': {"###", "#.#", "###", "..#", "###"},
	'.': {"...", "...", "...", "...", ".#."}, '%': {"#.#", "..#", ".#.", "#..", "#.#"},
	' ': {"...", "...", "...", "...", "..."}, '-': {"...", "...", "###", "...", "..."},
	'/': {"..#", "..#", ".#.", "#..", "#.."}, '(': {".#.", "#..", "#..", "#..", ".#."},
	')': {".#.", "..#", "..#", "..#", ".#."}, ',': {"...", "...", "...", ".#.", "#.."},
	'a': {"...", "##.", "..#", "###", "###"}, 'b': {"#..", "#..", "###", "#.#", "###"},
	'c': {"...", "###", "#..", "#..", "###"}, 'd': {"..#", "..#", "###", "#.#", "###"},
	'e': {"###", "#.#", "###", "#..", "###"}, 'f': {".##", "#..", "###", "#..", "#.."},
	'g': {"###", "#.#", "###", "..#", "##."}, 'h': {"#..", "#..", "###", "#.#", "#.#"},
	'i': {".#.", "...", ".#.", ".#.", ".#."}, 'k': {"#..", "#.#", "##.", "#.#", "#.#"},
	'l': {"#..", "#..", "#..", "#..", ".##"}, 'm': {"...", "###", "###", "#.#", "#.#"},
	'n': {"...", "##.", "#.#", "#.#", "#.#"}, 'o': {"...", "###", "#.#", "#.#", "###"},
	'p': {"###", "#.#", "###", "#..", "#.."}, 'r': {"...", "###", "#..", "#..", "#.."},
	's': {"###", "#..", "###", "..#", "###"}, 't': {"#..", "###", "#..", "#..", ".##"},
	'u': {"...", "#.#", "#.#", "#.#", "###"}, 'w': {"...", "#.#", "#.#", "###", "###"},
	'x': {"...", "#.#", ".#.", "#.#", "#.#"}, 'y': {"#.#", "#.#", "###", "..#", "##."},
	'z': {"...", "###", ".#.", "#..", "###"}, 'j': {"..#", "...", "..#", "#.#", "###"},
	'v': {"...", "#.#", "#.#", "#.#", ".#."}, 'q': {"###", "#.#", "###", "..#", "..#"},
}

const glyphScale = 2

func textWidth(s string) int { return len(s) * 4 * glyphScale }

// label writes s (lower case; unknown characters as blanks) at x, y.
func label(img *image.RGBA, x, y int, s string, c color.RGBA) {
	for i, r := range strings.ToLower(s) {
		g, ok := glyphs[r]
		if !ok {
			continue
		}
		for row, bits := range g {
			for col, b := range bits {
				if b != '#' {
					continue
				}
				for dy := range glyphScale {
					for dx := range glyphScale {
						img.SetRGBA(x+i*4*glyphScale+col*glyphScale+dx, y+row*glyphScale+dy, c)
					}
				}
			}
		}
	}
}
