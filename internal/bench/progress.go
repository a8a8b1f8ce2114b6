package bench

import (
	"fmt"
	"io"
	"os"
	"strings"
	"sync"
	"time"

	"golang.org/x/sys/unix"
)

// Progress draws a progress bar for the phase that is running. On a
// terminal it redraws one line in place (at most every 100 ms); elsewhere
// (CI logs, a file) it prints a line at every tenth, so logs stay short.
// A nil *Progress does nothing, which is what tests and JSON-only runs use.
type Progress struct {
	w   io.Writer
	tty bool

	mu       sync.Mutex
	label    string
	total    int
	done     int
	failed   int
	start    time.Time
	lastDraw time.Time
	lastTen  int
}

// NewProgress draws on w (normally os.Stderr).
func NewProgress(w io.Writer) *Progress {
	p := &Progress{w: w}
	if f, ok := w.(*os.File); ok {
		_, err := unix.IoctlGetTermios(int(f.Fd()), unix.TCGETS)
		p.tty = err == nil
	}
	return p
}

// Start begins a phase of total steps.
func (p *Progress) Start(label string, total int) {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.label, p.total, p.done, p.failed = label, total, 0, 0
	p.start, p.lastDraw, p.lastTen = time.Now(), time.Time{}, 0
	p.draw(true)
}

// Step records one finished step; failed steps are counted separately.
func (p *Progress) Step(ok bool) {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	p.done++
	if !ok {
		p.failed++
	}
	p.draw(false)
}

// Finish ends the phase, leaving its last line on screen.
func (p *Progress) Finish() {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.tty {
		p.draw(true)
		fmt.Fprintln(p.w)
	} else if p.lastTen < 10 {
		p.lastTen = 9 // force the final line
		p.draw(false)
	}
	p.total = 0
}

// Note prints a message between phases (not over a bar being drawn).
func (p *Progress) Note(format string, args ...any) {
	if p == nil {
		return
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.tty && p.total > 0 {
		fmt.Fprint(p.w, "\r\033[K")
	}
	fmt.Fprintf(p.w, format+"\n", args...)
	if p.tty && p.total > 0 {
		p.draw(true)
	}
}

func (p *Progress) draw(force bool) {
	now := time.Now()
	if p.tty {
		if !force && p.done < p.total && now.Sub(p.lastDraw) < 100*time.Millisecond {
			return
		}
		p.lastDraw = now
		fmt.Fprint(p.w, "\r\033[K"+p.line(now))
		return
	}
	ten := 0
	if p.total > 0 {
		ten = p.done * 10 / p.total
	}
	if force || ten > p.lastTen {
		p.lastTen = ten
		fmt.Fprintln(p.w, p.line(now))
	}
}

// line renders "label [#####.....] 50/100 12.3/s 4.1s".
func (p *Progress) line(now time.Time) string {
	const width = 30
	fill := 0
	if p.total > 0 {
		// A scenario that runs until its count is reached (restart) may
		// step past the total.
		fill = min(p.done*width/p.total, width)
	}
	el := now.Sub(p.start)
	rate := 0.0
	if el > 0 {
		rate = float64(p.done) / el.Seconds()
	}
	s := fmt.Sprintf("%-22s [%s%s] %d/%d %.1f/s %s", p.label,
		strings.Repeat("#", fill), strings.Repeat(".", width-fill),
		p.done, p.total, rate, el.Round(100*time.Millisecond))
	if p.failed > 0 {
		s += fmt.Sprintf(" (%d failed)", p.failed)
	}
	return s
}
