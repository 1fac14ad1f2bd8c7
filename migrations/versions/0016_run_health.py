"""run health: attempts of a job, where every rank is, failures, declared pauses, the run's state

``runs.job_id`` / ``runs.attempt``: runs that share a job identity (owner, job id) are attempts of one
job, ordered by ``attempt``; a name is unique per (owner, attempt) instead of per owner, so attempt k
of a job is a run of its own that all its ranks join idempotently.

``run_positions`` holds the latest position each rank reported (``position`` events: the step open,
its phase, the collective the rank waits in or last issued, a bounded stack): one row per (run, rank),
overwritten, so it is bounded by the world size. ``run_failures`` holds ``failure`` events: at most one
per (run, rank, source), at most ``MAX_FAILURES_PER_RUN`` per run (the rest counted in
``run_event_counts`` kind ``failure``). ``run_pauses`` holds declared pauses (checkpoint, evaluation,
``run.pause``) per (run, rank, reason): the open one and the time spent in ended ones. ``run_health``
is what the health pass last concluded about a run (state, since, finding, detail) and the last
progress it saw.

Revision ID: 0016
Revises: 0015
"""
from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None


def _fk(table: str) -> sa.ForeignKeyConstraint:
    return sa.ForeignKeyConstraint(['run_id'], ['runs.id'], name=op.f(f'fk_{table}_run_id_runs'), ondelete='CASCADE')


def upgrade() -> None:
    op.add_column('runs', sa.Column('job_id', sa.String(length=128), nullable=True))
    op.add_column('runs', sa.Column('attempt', sa.Integer(), nullable=False, server_default='0'))
    op.drop_constraint(op.f('uq_runs_owner_key_name'), 'runs', type_='unique')
    op.create_unique_constraint(op.f('uq_runs_owner_key_name_attempt'), 'runs', ['owner_key', 'name', 'attempt'])
    op.create_index(op.f('ix_runs_job_id'), 'runs', ['job_id'], unique=False)
    op.create_table(
        'run_positions',
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('seq', sa.BigInteger(), nullable=False),
        sa.Column('ts', sa.Double(), nullable=True),
        sa.Column('step', sa.BigInteger(), nullable=True),
        sa.Column('state', sa.String(length=16), nullable=True),
        sa.Column('phase', sa.String(length=64), nullable=True),
        sa.Column('open_s', sa.Double(), nullable=True),
        sa.Column('coll_op', sa.String(length=64), nullable=True),
        sa.Column('coll_dim', sa.String(length=64), nullable=True),
        sa.Column('coll_group', sa.String(length=128), nullable=True),
        sa.Column('coll_seq', sa.BigInteger(), nullable=True),
        sa.Column('coll_bytes', sa.BigInteger(), nullable=True),
        sa.Column('coll_since_s', sa.Double(), nullable=True),
        sa.Column('coll_done', sa.Boolean(), nullable=True),
        sa.Column('stack', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column('source', sa.String(length=32), nullable=True),
        sa.Column('received_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        _fk('run_positions'),
        sa.PrimaryKeyConstraint('run_id', 'rank', name=op.f('pk_run_positions')),
    )
    op.create_table(
        'run_failures',
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('source', sa.String(length=16), nullable=False),
        sa.Column('ts', sa.Double(), nullable=True),
        sa.Column('step', sa.BigInteger(), nullable=True),
        sa.Column('exception', sa.String(length=256), nullable=True),
        sa.Column('message', sa.Text(), nullable=True),
        sa.Column('frames', postgresql.JSONB(astext_type=sa.Text()), nullable=True),
        sa.Column('phase', sa.String(length=64), nullable=True),
        sa.Column('signal', sa.String(length=32), nullable=True),
        sa.Column('exit_code', sa.Integer(), nullable=True),
        sa.Column('received_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        _fk('run_failures'),
        sa.PrimaryKeyConstraint('run_id', 'rank', 'source', name=op.f('pk_run_failures')),
    )
    op.create_table(
        'run_pauses',
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('rank', sa.Integer(), nullable=False),
        sa.Column('reason', sa.String(length=64), nullable=False),
        sa.Column('seq', sa.BigInteger(), nullable=False, server_default='-1'),
        sa.Column('open_since', sa.Double(), nullable=True),
        sa.Column('expected_s', sa.Double(), nullable=True),
        sa.Column('total_s', sa.Double(), nullable=False, server_default='0'),
        sa.Column('count', sa.Integer(), nullable=False, server_default='0'),
        sa.Column('received_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        _fk('run_pauses'),
        sa.PrimaryKeyConstraint('run_id', 'rank', 'reason', name=op.f('pk_run_pauses')),
    )
    op.create_table(
        'run_health',
        sa.Column('run_id', sa.Integer(), nullable=False),
        sa.Column('state', sa.String(length=16), nullable=False, server_default='running'),
        sa.Column('since', sa.DateTime(timezone=True), nullable=True),
        sa.Column('finding', sa.Text(), nullable=True),
        sa.Column('detail', postgresql.JSONB(astext_type=sa.Text()), server_default='{}', nullable=False),
        sa.Column('last_step', sa.BigInteger(), nullable=True),
        sa.Column('progress_at', sa.DateTime(timezone=True), nullable=True),
        sa.Column('hang_s', sa.Double(), nullable=False, server_default='0'),
        sa.Column('updated_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        _fk('run_health'),
        sa.PrimaryKeyConstraint('run_id', name=op.f('pk_run_health')),
    )


def downgrade() -> None:
    op.drop_table('run_health')
    op.drop_table('run_pauses')
    op.drop_table('run_failures')
    op.drop_table('run_positions')
    op.drop_index(op.f('ix_runs_job_id'), table_name='runs')
    op.drop_constraint(op.f('uq_runs_owner_key_name_attempt'), 'runs', type_='unique')
    op.create_unique_constraint(op.f('uq_runs_owner_key_name'), 'runs', ['owner_key', 'name'])
    op.drop_column('runs', 'attempt')
    op.drop_column('runs', 'job_id')
