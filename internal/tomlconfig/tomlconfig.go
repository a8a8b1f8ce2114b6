// Package tomlconfig is how every cube daemon reads its TOML config: the
// embedded defaults first, then the operator's file merged over them with
// unknown keys refused (a typo must not silently fall back to a default).
package tomlconfig

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"time"

	toml "github.com/pelletier/go-toml/v2"

	"github.com/cubesandbox/cube/internal/errdefs"
)

// Decode fills v from defaults, then from overlay (which may be empty).
// Errors in overlay wrap errdefs.ErrInvalidArgument.
func Decode(defaults, overlay []byte, v any) error {
	if err := toml.Unmarshal(defaults, v); err != nil {
		return fmt.Errorf("embedded config: %w", err)
	}
	if len(overlay) == 0 {
		return nil
	}
	dec := toml.NewDecoder(bytes.NewReader(overlay)).DisallowUnknownFields()
	if err := dec.Decode(v); err != nil {
		var sme *toml.StrictMissingError
		if errors.As(err, &sme) {
			return fmt.Errorf("%s: %w", sme.String(), errdefs.ErrInvalidArgument)
		}
		return fmt.Errorf("%v: %w", err, errdefs.ErrInvalidArgument)
	}
	return nil
}

// Duration is a time.Duration written as "20s" in TOML.
type Duration struct{ time.Duration }

// UnmarshalText implements encoding.TextUnmarshaler.
func (d *Duration) UnmarshalText(b []byte) error {
	v, err := time.ParseDuration(string(b))
	if err != nil {
		return err
	}
	d.Duration = v
	return nil
}

// MarshalText implements encoding.TextMarshaler.
func (d Duration) MarshalText() ([]byte, error) { return []byte(d.String()), nil }

// Validator is a config that checks itself once decoded (and may fill in
// fields derived from others).
type Validator interface{ Validate() error }

// Parse decodes defaults, then data over them, into a new T and validates
// it.
func Parse[T any, PT interface {
	*T
	Validator
}](defaults, data []byte) (*T, error) {
	c := new(T)
	if err := Decode(defaults, data, c); err != nil {
		return nil, err
	}
	if err := PT(c).Validate(); err != nil {
		return nil, err
	}
	return c, nil
}

// Load is Parse for the file at path; an empty path means the defaults
// alone. Errors name the file.
func Load[T any, PT interface {
	*T
	Validator
}](defaults []byte, path string) (*T, error) {
	if path == "" {
		return Parse[T, PT](defaults, nil)
	}
	data, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("read config: %w", err)
	}
	c, err := Parse[T, PT](defaults, data)
	if err != nil {
		return nil, fmt.Errorf("config %s: %w", path, err)
	}
	return c, nil
}
