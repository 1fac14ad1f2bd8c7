"""device telemetry per rank and window (issue: Why this GPU)

``run_devices`` holds one row per (run, rank, window) of the agent's ``device`` events (NVML, aggregated
per window on the sender thread): clocks, power, temperature, utilisation, memory, the throttle reasons
(a bit mask over ``server/device_wire.REASONS``) and the seconds throttled, ECC error deltas, XID codes.
Narrow on purpose (REAL columns, NULL for what a device does not report, the per-reason seconds as JSONB
only in throttled windows): about 140 bytes per window with its key, ≤ 5 % of a rank's step records'
bytes at the agent's window length (docs/benchmarks.md, "Device telemetry"). At most
``MAX_DEVICE_WINDOWS_PER_RUN`` rows per run (counted in ``run_event_counts`` kind ``device``). On Citus it
is distributed by run_id (run_id leads the primary key).

Revision ID: 0021
Revises: 0020
"""
from alembic import op  # noqa: F401
import sqlalchemy as sa  # noqa: F401
from sqlalchemy.dialects import postgresql

revision = '0021'
down_revision = '0020'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'run_devices',
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('t_ms', sa.BigInteger(), nullable=False),
        sa.Column('window_s', sa.REAL(), nullable=False),
        sa.Column('samples', sa.Integer(), nullable=False),
        sa.Column('sm_clock_min', sa.REAL(), nullable=True),
        sa.Column('sm_clock_mean', sa.REAL(), nullable=True),
        sa.Column('sm_clock_max', sa.REAL(), nullable=True),
        sa.Column('mem_clock_mean', sa.REAL(), nullable=True),
        sa.Column('power_mean', sa.REAL(), nullable=True),
        sa.Column('power_max', sa.REAL(), nullable=True),
        sa.Column('power_limit', sa.REAL(), nullable=True),
        sa.Column('temp_mean', sa.REAL(), nullable=True),
        sa.Column('temp_max', sa.REAL(), nullable=True),
        sa.Column('util_mean', sa.REAL(), nullable=True),
        sa.Column('mem_used_max', sa.BigInteger(), nullable=True),
        sa.Column('throttle', sa.Integer(), nullable=False, server_default='0'),
        sa.Column('throttled_s', sa.REAL(), nullable=False, server_default='0'),
        sa.Column('throttle_s', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column('ecc_errors', sa.Integer(), nullable=True),
        sa.Column('xid', postgresql.ARRAY(sa.Integer()), nullable=True),
        sa.Column('step', sa.BigInteger(), nullable=True),
        sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f('fk_run_devices_run_id_runs'), ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('run_id', 'rank', 't_ms', name=op.f('pk_run_devices')),
    )


def downgrade() -> None:
    op.drop_table('run_devices')
